"""Where an image can run: the fleet's and a request's models, the rules, the decision, the exports.

Pure: no HTTP, no SQL, no file or registry I/O (callers read and hand in reports, inventories and
NFD documents). From scanner/ it imports the report models (`scanner.models`), the requirement
grammar (`scanner.facts.requirements`), the fatbin facts' PTX table (`scanner.layers.fatbin`) and
the NFD bounds' settings (`scanner.settings`); nothing of store/ or web/.

Rooms: `inventory.py`, `request.py`, `protocol.py` (models); `image_facts.py` (what placement reads
of a report); `nvidia_require.py` (NVIDIA_REQUIRE_* as the runtime evaluates it), `gpu_code.py`,
`cuda_needs.py`, `gpus.py`, `mig.py` (rules); `index.py` (the fleet index), `query.py` (a request compiled
against it), `decision.py` (the paged answer's buckets), `decide.py` (`decide`), `answer.py`;
`admission.py`; `exports/` and `nfd/`.
"""
