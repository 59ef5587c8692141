"""Codec quality (``python -m benchmarks quality``): reconstruction error and a synthetic needle
(``synthetic``), top-1 and KL through vLLM on the demo model (``through_vllm``), and needles through
vLLM on models that retrieve (``needle``): the constructed one (``constructed``, to 128k tokens) and a
trained one (``retrieval``), with the naive per-tensor 4-bit reference codec (``naive_codec``)."""
