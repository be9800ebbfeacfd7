"""An image config -> what the image declares: GPU signals and NVIDIA_REQUIRE_* (`gpu.py`,
`require_grammar.py`), badges, and which platforms get their layers read. Pure."""
