"""One model file per family; MODELS maps the family (from config.json's model_type) to its class."""
from .qwen3_5 import Qwen3_5ForCausalLM
from .qwen3_5_moe import Qwen3_5MoeForCausalLM
from .qwen3_next import Qwen3NextForCausalLM

MODELS = {m.family: m for m in (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM)}
