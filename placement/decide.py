"""Which servers can run an image for a deploy request, best fit first, and why the others cannot.

Pure: facts + request + inventory in, a Decision out. `decide` compiles the request against a
`FleetIndex` (placement.index) into a `Query` (placement.query), judges each server shape once and
each label set once, and returns a `Decision` (placement.decision) that lists single servers only
for the page a caller asks for. Verdicts and decisions are kept in the index per query form.
"""

from __future__ import annotations

from collections.abc import Sequence

from placement import cuda_needs
from placement.decision import Bucket, Decision
from placement.image_facts import ImageFacts
from placement.index import FleetIndex
from placement.inventory import Server
from placement.query import Query
from placement.request import DeployRequest


def decide(image: ImageFacts, request: DeployRequest, inventory: Sequence[Server] | FleetIndex) -> Decision:
    """Rank the servers that can run `image` for `request`; explain every server that cannot.

    Ranking is best fit: preferred model first (when `gpu_model_order` is 'ordered'), then fewest
    spare GPUs left on the server, then the least GPU memory that still suffices, then fewest spare
    CPUs, then name. The work is per server shape (and label set), never per server: the Decision
    holds the servers of each shape as shared lists and lists single servers only when asked.
    Pure: reads the index, changes nothing (an index shared with other threads may be read
    concurrently as long as its `view()` was built before).
    """
    index = inventory if isinstance(inventory, FleetIndex) else FleetIndex.build(inventory)
    view = index.view()
    form = _form(image, request)
    # The same question on the same view has the same (immutable) answer.
    kept = index.kept_decision(form, view)
    if kept is not None:
        return kept
    query = Query(image, request, index, view)
    # A shape's verdict depends on the shape and the query only, so it is kept per query form
    # (image facts and request) and shape id: after a fleet change, only shapes new to it are judged.
    known = index.shape_results(form)
    results = []
    for entry, gpu_shape in zip(view.shape_entries, view.shape_gpu, strict=True):
        result = known.get(entry.shape)
        if result is None:
            result = known[entry.shape] = query.evaluate(entry, gpu_shape)
        results.append(result)
    # The caveats below read the verdicts of the GPU classes judged: those of shape verdicts and GPU
    # parts kept from earlier questions were judged then, so every class in the answer is judged here.
    query.judge_present_classes(view)
    labels = list(request.labels.items())
    eligible: list[Bucket] = []
    refused: list[Bucket] = []
    if labels:
        missing = [_label_reasons(have, labels) for have in index.label_sets]
        for combo, (shape, label_set) in enumerate(view.combos):
            if not view.combo_names[combo]:
                continue  # every server left this combination since the view was built
            result = results[shape]
            reasons = (*result[0], *missing[label_set])
            bucket = Bucket(result, view.combo_names[combo], view.combo_groups[combo], reasons)
            (refused if reasons else eligible).append(bucket)
    else:
        for shape, result in enumerate(results):
            if not view.shape_names[shape]:
                continue
            bucket = Bucket(result, view.shape_names[shape], view.shape_groups[shape], result[0])
            (refused if result[0] else eligible).append(bucket)
    warnings = list(dict.fromkeys(w for plan in query.plans.values() for w in plan.requirements.warnings))
    warnings += [caveat for caveat in dict.fromkeys(query.caveats()) if caveat not in warnings]
    warnings += image.outdated
    hints = [
        hint
        for hint in (
            cuda_needs.hint(
                [platform.gpu for platform in image.platforms], request.gpus or request.slices_needed
            ),
            image.idle_gpus_hint(request.gpus, request.slices_needed),
            image.mig_devices_hint(request.slices_needed),
        )
        if hint
    ]
    decision = Decision(eligible, refused, warnings, hints, image.pending, image_gpu=image.gpu_use)
    index.keep_decision(form, view, decision)
    return decision


def kept_decision(image: ImageFacts, request: DeployRequest, index: FleetIndex) -> Decision | None:
    """What `decide` answered to this question on the index as it is now, if the index still keeps
    it (the same query form, no fleet change since); None otherwise. Costs the form's text only."""
    return index.kept_decision(_form(image, request), index.view())


def _form(image: ImageFacts, request: DeployRequest) -> tuple[str, str]:
    """A question's form: the same form on the same view of the fleet has the same answer."""
    return (image.model_dump_json(), request.model_dump_json())


def _label_reasons(have: dict[str, str], wanted: list[tuple[str, str]]) -> list[str]:
    reasons = []
    for label, value in wanted:
        current = have.get(label)
        if current != value:
            suffix = f" (server has {label}={current})" if current is not None else ""
            reasons.append(f"label {label}={value} missing{suffix}")
    return reasons
