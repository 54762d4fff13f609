"""Images and video for Qwen3.5's vision tower: the config (``config``), loading (``load``),
decoding and preprocessing (``preprocess``; video: ``video``), the encoder (``encoder``),
M-RoPE positions (``positions``), a request's image and video inputs (``tower``), the runner's
per-step hook (``step``), the MTP layer's (``mtp``), the scheduler's encoder budget
(``budget``), the encoder-output cache (``encoder_cache``), what each interface accepts or
refuses (``inputs``) and the server's media URLs (``fetch``). docs/vision.md describes the
whole."""
