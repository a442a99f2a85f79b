"""--kv-cache-dtype (vLLM's name and values), kept free of torch so the command lines can offer it at import.

"auto" keeps K and V in the model's dtype (bf16 on the GPU); "fp8" / "fp8_e4m3" stores E4M3 codes (one byte an
element, scale 1: the _fp8 attention ops), which halves the cache's bytes and doubles the context a pool holds.
"""
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def kv_element_bytes(kv_cache_dtype: str) -> int:
    """Bytes per cached K or V element on the GPU (the benches' rooflines)."""
    return 2 if kv_cache_dtype == "auto" else 1
