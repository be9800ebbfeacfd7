"""Layer bytes -> verdicts: one bounded walk of each layer feeds every consumer (libc, carried
CUDA, GPU code). Pure: bytes in, verdicts out; the bytes are fetched by `scanner.layer_reader`,
and nothing here imports `scanner.registry`. `analysis.py` runs the walk in analysis processes."""
