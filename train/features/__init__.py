"""The optional training features: checkpoint averaging, gradual unfreezing, the LR range test, distillation, quantization (QAT and PTQ), pruning and DDP's gradient compression."""
