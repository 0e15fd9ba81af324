"""The architecture records: one per Hugging Face decoder class (record.py says what a record holds).

`RECORDS` in the order a model's class is chosen on export: the first whose needs and mays fit the model
(the class it was loaded from first, when that still fits).
"""
from .cohere import Cohere2
from .deepseek import DeepseekV3, DeepseekV32, GlmMoeDsa, Mistral4
from .gemma import Gemma2, Gemma3, Gemma4
from .glm import Glm4
from .gpt_oss import GptOss
from .granite import GraniteMoeHybrid
from .lfm2 import Lfm2
from .llama import Llama, Mistral, Mixtral
from .olmo import Olmo2, Olmo3
from .phi import Phi3
from .qwen import Qwen2, Qwen2Moe, Qwen3, Qwen3Moe
from .qwen3_5 import Qwen3_5, Qwen3_5Moe, Qwen3Next
from .record import FEATURES, Record, features, interleaved
from .smollm import SmolLM3

RECORDS: dict[str, Record] = {r.hf_class: r for r in (
    Llama(), Mistral(), Qwen2(), Qwen3(), SmolLM3(), Olmo2(), Olmo3(), Phi3(), Gemma2(), Gemma3(), Gemma4(), Glm4(), Cohere2(),
    Mixtral(), Qwen3Moe(), Qwen2Moe(), DeepseekV3(), DeepseekV32(), GlmMoeDsa(), Mistral4(), GptOss(), Lfm2(), Qwen3_5(), Qwen3Next(),
    Qwen3_5Moe(), GraniteMoeHybrid())}
BY_MODEL_TYPE = {r.model_type: r for r in RECORDS.values()}
BY_GGUF = {r.gguf: r for r in RECORDS.values() if r.gguf}
BY_WRAPPER = {r.wrapper[0]: r for r in RECORDS.values() if r.wrapper}

__all__ = ["RECORDS", "BY_MODEL_TYPE", "BY_GGUF", "BY_WRAPPER", "FEATURES", "Record", "features", "interleaved"]
