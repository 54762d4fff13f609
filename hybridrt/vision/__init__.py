"""Images and video for Qwen3.5's vision tower: what the interfaces accept of them
(``inputs``) and whether a checkpoint can take them."""
