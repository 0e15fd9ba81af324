"""The optional training features: checkpoint averaging, gradual unfreezing, the LR range test, distillation, quantization (QAT and PTQ) and pruning."""
