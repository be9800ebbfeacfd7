"""What an image is and needs, read from its registry.

- `registry/`: image references and the only code that talks to registries (reads through
  `client.py`, writes through `push.py`, the referrers protocol in `referrers.py`);
- `facts/`: the image config -> what the image declares (NVIDIA_* variables, their grammar,
  badges, which platforms get their layers read). Pure;
- `layers/`: one walk of each layer's bytes -> libc, carried CUDA and GPU code, bounded. Pure,
  run in analysis processes (`layers/analysis.py`); it imports nothing from `registry/`;
- `scan.py` drives both for one reference, `layer_reader.py` fetches each layer once into the
  walk, `publish.py` attaches finished reports (and their companions) as OCI referrers;
- `models.py` the reports, `settings.py` the settings, `cache.py` the storage protocol the
  store satisfies.

Nothing here imports placement/, store/ or web/.
"""
