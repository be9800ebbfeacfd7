"""What an image and a request demand of a node, as plain constraints every export translates.

gpubadge decides eligibility itself (placement.decide); a scheduler that places the container
must decide it again from what it knows about a node. This module turns the image's
NVIDIA_REQUIRE_* (with the runtime's short-circuit and error rules), gpubadge's own image rules
and the request into a disjunction of `Term`s over the facts schedulers publish: the driver
version, the CUDA version the driver supports, the compute capability, the GPU product (for
brand and model clauses, which no scheduler can test directly) and per-GPU memory.

A request for MIG devices keeps the same terms (they hold for a MIG device's parent GPU) and
adds the MIG devices asked for (`PlatformConstraints.mig_devices`): the profiles named, and the
known fleet's (parent product, profile) pairs that satisfy the request (`mig_choices`), which
each format spells in its own way (a resource name, a product label, a device class).

Versions compare as nvidia-container-cli compares them: component by component, numerically,
missing components counting as zero (`12.2 == 12.2.0`, `470.57.02 > 470`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import product

from placement import cuda_needs
from placement.gpu_code import Rule
from placement.gpus import MEMORY_TOLERANCE, RUNTIME_BRANDS, matches_model, runtime_brands
from placement.image_facts import ImageFacts, PlatformFacts
from placement.index import FleetIndex, GpuClass
from placement.mig import sort_key
from placement.nvidia_require import ImageRequirements
from placement.request import DeployRequest
from scanner.facts.require_grammar import KEYS, OPERATORS, Condition, Expression, digits_value, latent_error
from scanner.models import GpuFacts

Version = tuple[int, ...]
DIMENSIONS = ("driver", "cuda", "cc")  # driver version, driver's CUDA version, compute capability
MAX_TERMS = 256  # a requirement that expands beyond this is approximated (and the notes say so)
_MIB = 1024**2


def canonical(parts: Iterable[int]) -> Version:
    """Trailing zeros dropped: the runtime treats `12.2.0` as `12.2`."""
    parts = list(parts)
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def parse_version(text: str) -> Version | None:
    """A requirement value as the runtime reads it; None when it is not a version."""
    if not text or text.startswith(".") or set(text) - set("0123456789."):
        return None
    values = [digits_value(part) for part in text.split(".") if part]
    if any(value is None for value in values):
        return None  # past any uint64: the runtime refuses it too
    return canonical(value or 0 for value in values)


def compare(left: Version, right: Version) -> int:
    width = max(len(left), len(right))
    a = left + (0,) * (width - len(left))
    b = right + (0,) * (width - len(right))
    return (a > b) - (a < b)


@dataclass(frozen=True, slots=True)
class Bound:
    version: Version
    inclusive: bool


@dataclass(frozen=True, slots=True)
class Interval:
    """Versions between `low` and `high` (None: unbounded)."""

    low: Bound | None = None
    high: Bound | None = None

    def empty(self) -> bool:
        if self.low is None or self.high is None:
            return False
        order = compare(self.low.version, self.high.version)
        return order > 0 or (order == 0 and not (self.low.inclusive and self.high.inclusive))

    def __and__(self, other: Interval) -> Interval:
        return Interval(_tighter(self.low, other.low, 1), _tighter(self.high, other.high, -1))

    def contains(self, other: Interval) -> bool:
        """Every version in `other` is in self."""
        return _looser_or_equal(self.low, other.low, 1) and _looser_or_equal(self.high, other.high, -1)

    def holds(self, version: Version) -> bool:
        if self.low is not None:
            order = compare(version, self.low.version)
            if order < 0 or (order == 0 and not self.low.inclusive):
                return False
        if self.high is not None:
            order = compare(version, self.high.version)
            if order > 0 or (order == 0 and not self.high.inclusive):
                return False
        return True


def _tighter(a: Bound | None, b: Bound | None, sign: int) -> Bound | None:
    """The stricter of two lower (sign 1) or upper (sign -1) bounds."""
    if a is None or b is None:
        return a or b
    order = compare(a.version, b.version) * sign
    if order != 0:
        return a if order > 0 else b
    return a if not a.inclusive else b


def _looser_or_equal(mine: Bound | None, theirs: Bound | None, sign: int) -> bool:
    if mine is None:
        return True
    if theirs is None:
        return False
    order = compare(mine.version, theirs.version) * sign
    return order < 0 or (order == 0 and (mine.inclusive or not theirs.inclusive))


@dataclass(frozen=True, slots=True)
class Term:
    """One alternative: every listed fact must hold. `products` None means any GPU product."""

    versions: tuple[tuple[str, Interval], ...] = ()  # (dimension, interval), at most one per dimension
    products: frozenset[str] | None = None  # NVML names (as the known fleet reports them)

    def interval(self, dimension: str) -> Interval | None:
        return next((interval for name, interval in self.versions if name == dimension), None)

    def __and__(self, other: Term) -> Term | None:
        merged = dict(self.versions)
        for name, interval in other.versions:
            merged[name] = merged[name] & interval if name in merged else interval
            if merged[name].empty():
                return None
        if self.products is None:
            products = other.products
        elif other.products is None:
            products = self.products
        else:
            products = self.products & other.products
            if not products:
                return None
        ordered = tuple((name, merged[name]) for name in DIMENSIONS if name in merged)
        return Term(ordered, products)

    def contains(self, other: Term) -> bool:
        """Every node `other` admits, self admits too."""
        if self.products is not None and (other.products is None or not other.products <= self.products):
            return False
        for name, interval in self.versions:
            theirs = other.interval(name)
            if not interval.contains(theirs if theirs is not None else Interval()):
                return False
        return True


TRUE: list[Term] = [Term()]
FALSE: list[Term] = []


def disjunction(terms: Iterable[Term]) -> list[Term]:
    """Terms without duplicates or terms another term already covers, in first-seen order."""
    kept: list[Term] = []
    for term in terms:
        if any(other.contains(term) for other in kept):
            continue
        kept = [other for other in kept if not term.contains(other)]
        kept.append(term)
    return kept


def conjunction(left: list[Term], right: list[Term]) -> list[Term]:
    return disjunction(t for a, b in product(left, right) if (t := a & b) is not None)


# --- NVIDIA_REQUIRE_* -> terms -------------------------------------------------------------------


_DIMENSION_OF = {"driver": "driver", "cuda": "cuda", "arch": "cc"}
_OPPOSITE = {">=": "<", ">": "<=", "<=": ">", "<": ">=", "=": "!=", "!=": "="}


def _version_terms(dimension: str, op: str, version: Version) -> list[Term]:
    def one(low: Bound | None = None, high: Bound | None = None) -> Term:
        return Term(((dimension, Interval(low, high)),))

    if op == ">=":
        return [one(low=Bound(version, True))]
    if op == ">":
        return [one(low=Bound(version, False))]
    if op == "<=":
        return [one(high=Bound(version, True))]
    if op == "<":
        return [one(high=Bound(version, False))]
    if op == "=":
        return [one(Bound(version, True), Bound(version, True))]
    return [one(high=Bound(version, False)), one(low=Bound(version, False))]


@dataclass(frozen=True, slots=True)
class _Factor:
    """A factor's outcome over nodes: where it is true, false, or an error (the container fails)."""

    true: list[Term]
    false: list[Term]
    error: bool  # some node makes it an error


def _factor(condition: Condition, brand: str | None) -> _Factor:
    """`brand` None: no GPU is assigned, so the runtime's arch and brand rules hold without looking;
    `brand` "": a GPU whose brand NVML does not report (the brand rule holds)."""
    if condition.key not in KEYS or condition.op not in OPERATORS or not condition.value:
        return _Factor(FALSE, FALSE, True)  # rejected before any rule runs: an error wherever reached
    if brand is None and condition.key in ("arch", "brand"):
        return _Factor(TRUE, FALSE, False)
    if brand == "" and condition.key == "brand":
        return _Factor(TRUE, FALSE, False)  # NVML gave no brand: the rule holds without looking
    if condition.key == "brand":
        if condition.op not in ("=", "!="):
            return _Factor(FALSE, FALSE, True)
        same = brand is not None and brand.lower() == condition.value.lower()
        holds = same if condition.op == "=" else not same
        return _Factor(TRUE if holds else FALSE, FALSE if holds else TRUE, False)
    version = parse_version(condition.value)
    if version is None:
        return _Factor(FALSE, FALSE, True)
    dimension = _DIMENSION_OF[condition.key]
    if latent_error(condition) is not None:
        # Too long or too large for the runtime: true where it holds, an error where it is false
        # (a too-large number is an error wherever compared: approximated as where it is false).
        return _Factor(_version_terms(dimension, condition.op, version), FALSE, True)
    return _Factor(
        _version_terms(dimension, condition.op, version),
        _version_terms(dimension, _OPPOSITE[condition.op], version),
        False,
    )


def expression_terms(expression: Expression, brand: str | None) -> list[Term]:
    """Where the runtime accepts `expression` on a GPU of `brand`: short-circuit, errors when reached.

    Term i wins where all its factors hold; evaluation moves on to term i+1 only where some factor
    of term i is false, and stops (the container fails) where a factor it reaches is an error.
    Without error factors that is the plain OR of the AND-terms.
    """
    result = FALSE
    for term in reversed(expression.alternatives):
        factors = [_factor(condition, brand) for condition in term.conditions]
        all_true = TRUE
        reach_next = FALSE  # where this term fails cleanly (so the next term is tried)
        for factor in factors:
            reach_next = disjunction([*reach_next, *conjunction(all_true, factor.false)])
            all_true = conjunction(all_true, factor.true)
        if not any(factor.error for factor in factors):
            result = disjunction([*all_true, *result])
        else:
            result = disjunction([*all_true, *conjunction(reach_next, result)])
        if len(result) > MAX_TERMS:
            raise _TooComplex
    return result if expression.alternatives else TRUE


class _TooComplex(Exception):
    pass


# --- the known fleet ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KnownMigProfile:
    """A MIG profile gpubadge has seen on a GPU product: the device's memory and SMs."""

    profile: str  # e.g. "1g.10gb"
    memory_mib: int
    multiprocessors: int = 0


@dataclass(frozen=True, slots=True)
class KnownGpu:
    """A GPU product gpubadge has seen in the fleet, with what schedulers cannot label."""

    name: str  # NVML name, e.g. "NVIDIA H100 80GB HBM3"
    brand: str
    memory_mib: int
    compute_capability: str
    architectures: frozenset[str] = frozenset()  # CPU architectures of servers with it (empty: unknown)
    whole: bool = True  # seen out of MIG mode (False: only ever in MIG mode)
    mig_profiles: tuple[KnownMigProfile, ...] = ()  # the MIG devices seen on it, smallest first


def known_gpus(fleet: FleetIndex | Iterable[GpuClass]) -> list[KnownGpu]:
    """Distinct GPU products of an indexed fleet, with the CPU architectures they were seen on and
    the MIG profiles seen on them.

    Also takes bare GPU classes (`index.classes`); the architectures are then unknown.
    """
    seen_on: dict[str, set[str]] = {}
    classes: Iterable[GpuClass] = fleet.classes if isinstance(fleet, FleetIndex) else fleet
    if isinstance(fleet, FleetIndex):
        for entry in fleet.view().shape_entries:  # one server per shape: O(shapes)
            for gpu in entry.server.gpus:
                seen_on.setdefault(gpu.name, set()).add(entry.arch)
    products: dict[str, tuple[str, int, str]] = {}  # name -> (brand, memory, CC)
    whole: set[str] = set()
    profiles: dict[str, dict[str, KnownMigProfile]] = {}
    for known in classes:
        if not known.name:
            continue
        if known.mig_profile is None:
            whole.add(known.name)
            if known.name not in products or products[known.name][1] == 0:
                products[known.name] = (known.brand, known.memory_mib, known.compute_capability)
            continue
        products.setdefault(known.name, (known.brand, known.parent_memory_mib, known.compute_capability))
        profiles.setdefault(known.name, {}).setdefault(
            known.mig_profile, KnownMigProfile(known.mig_profile, known.memory_mib, known.multiprocessors)
        )
    found = [
        KnownGpu(
            name,
            brand,
            memory,
            cc,
            frozenset(seen_on.get(name, ())),
            whole=name in whole,
            mig_profiles=tuple(
                sorted(profiles.get(name, {}).values(), key=lambda known: sort_key(known.profile))
            ),
        )
        for name, (brand, memory, cc) in products.items()
    ]
    return sorted(found, key=lambda gpu: gpu.name)


@dataclass(frozen=True, slots=True)
class MigChoice:
    """A MIG device the known fleet offers that a request accepts: its parent product and profile."""

    product: str  # the parent's NVML name
    profile: str
    memory_mib: int
    multiprocessors: int


# --- image + request -> constraints ------------------------------------------------------------


@dataclass
class PlatformConstraints:
    """What a node of one CPU architecture must offer to run the image's platform for it."""

    architecture: str
    platform: str
    terms: list[Term]
    gpus: int  # whole GPUs
    min_memory_mib: int | None = None  # per GPU (or MIG device), after placement's memory tolerance
    mig_devices: int = 0  # MIG devices instead of whole GPUs
    mig_profiles: list[str] = field(default_factory=list)  # the profiles the request names (any: empty)
    mig_choices: list[MigChoice] = field(default_factory=list)  # known devices it accepts, smallest first

    @property
    def wants_gpu(self) -> bool:
        """Whole GPUs or MIG devices are asked for."""
        return self.gpus > 0 or self.mig_devices > 0

    def choices_for(self, term: Term) -> list[MigChoice]:
        """The MIG choices a term admits (its product list, if any, names their parents)."""
        if term.products is None:
            return list(self.mig_choices)
        return [choice for choice in self.mig_choices if choice.product in term.products]


@dataclass
class Constraints:
    """Every platform's constraints, plus what no scheduler label can say (`notes`)."""

    image: str | None
    platforms: list[PlatformConstraints]
    request: DeployRequest
    notes: list[str] = field(default_factory=list)
    brand_products: dict[str, list[str]] = field(default_factory=dict)  # brand -> products it became
    fleet: list[KnownGpu] = field(default_factory=list)  # the known GPU products

    @property
    def satisfiable(self) -> bool:
        return any(platform.terms for platform in self.platforms)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


ALL_BRANDS: tuple[str, ...] = tuple(dict.fromkeys(RUNTIME_BRANDS))


def _brand_key(requirements: ImageRequirements, brand: str) -> tuple[bool, ...]:
    """What the brand factors say for `brand`: brands with the same key get the same terms."""
    factors = (
        (brand.lower() == c.value.lower()) == (c.op == "=")
        for _, expression in requirements.expressions
        for c in expression.conditions
        if c.key == "brand" and c.error is None
    )
    return (brand == "", *factors)  # no brand at all makes every brand factor true


def _requirement_terms(requirements: ImageRequirements, brand: str | None) -> list[Term]:
    terms = TRUE
    for _, expression in requirements.expressions:
        terms = conjunction(terms, expression_terms(expression, brand))
        if not terms:
            break
    return terms


def build_constraints(image: ImageFacts, request: DeployRequest, fleet: Sequence[KnownGpu]) -> Constraints:
    """The constraints for `image` and `request`; brand and model clauses use the known `fleet`."""
    result = Constraints(image.reference, [], request, fleet=list(fleet))
    seen: set[str] = set()
    for platform in image.platforms:
        if platform.architecture in seen:
            continue
        seen.add(platform.architecture)
        result.platforms.append(_platform(platform, request, fleet, result))
    if not image.platforms:
        result.note("the image has no runnable platform")
    spread = image.mig_devices_hint(request.slices_needed)
    if spread:
        result.note(f"the image {spread}")
    if not result.satisfiable:
        result.note("no node can run this image with this request; the constraints match nothing")
    return result


def _platform(
    platform: PlatformFacts, request: DeployRequest, fleet: Sequence[KnownGpu], result: Constraints
) -> PlatformConstraints:
    gpu_image = platform.gpu.required
    slices = request.slices_needed
    needed = request.gpus if request.gpus is not None else (1 if gpu_image and not slices else 0)
    constraints = PlatformConstraints(platform.architecture, platform.platform, TRUE, needed)
    constraints.mig_devices = slices
    constraints.mig_profiles = list(request.mig_profiles)
    if not (gpu_image or constraints.wants_gpu):
        return constraints
    requirements = ImageRequirements.from_gpu_facts(platform.gpu)
    if requirements.error is not None:
        result.note(f"{platform.platform}: image requirement cannot be evaluated: {requirements.error}")
        constraints.terms = FALSE
        return constraints
    for warning in requirements.warnings:
        result.note(f"{platform.platform}: {warning}")
    if platform.libc.state == "pending":
        result.note(
            f"{platform.platform}: the image's layers are still being read; these constraints come from its"
            " config facts only (its libc, and CUDA inside, may add to them)"
        )
    if platform.libc.flavour == "musl" and gpu_image:
        result.note(
            f"{platform.platform}: the image uses musl libc with GPUs; no scheduler label says whether a "
            "node's NVIDIA libraries support musl"
        )
    terms = TRUE
    if not requirements.disabled and requirements.expressions:
        if not constraints.wants_gpu:
            note = "no GPU is requested, so the runtime checks without a device: brand and arch hold"
            result.note(f"{platform.platform}: {note}")
            try:
                terms = _requirement_terms(requirements, None)
            except _TooComplex:
                result.note(
                    f"{platform.platform}: the requirement expands to more than {MAX_TERMS} alternatives"
                )
                terms = FALSE
        else:
            terms = _brand_terms(requirements, fleet, platform.platform, result)
    elif requirements.disabled:
        result.note(f"{platform.platform}: NVIDIA_DISABLE_REQUIRE is set; the runtime checks nothing")
    # gpubadge's own image rule: CUDA 13 dropped GPUs below compute capability 7.5.
    cuda = cuda_needs.needed_cuda(platform.gpu) or ""  # the newest it declares or carries
    major = cuda.split(".", 1)[0]
    wants = constraints.wants_gpu
    if wants and major.isdigit() and int(major) >= 13:
        terms = conjunction(terms, [Term((("cc", Interval(low=Bound((7, 5), True))),))])
    if wants and (platform.gpu.inferred is not None or platform.gpu.archs is not None):
        rule = request.gpu_code_rule or "dispatch"
        terms = conjunction(terms, _inferred_terms(platform.gpu, platform.platform, result, rule))
    if wants:
        terms = conjunction(terms, _request_terms(request, fleet, result))
        if request.min_gpu_memory is not None:
            # placement.gpus.memory_satisfies: reported MiB >= requested bytes less the tolerance
            constraints.min_memory_mib = math.ceil(request.min_gpu_memory * (1 - MEMORY_TOLERANCE) / _MIB)
    if slices:
        constraints.mig_choices = _mig_choices(request, fleet, constraints.min_memory_mib)
        if not constraints.mig_choices:
            wanted = " or ".join(request.mig_profiles) or "any profile"
            result.note(
                f"{platform.platform}: the known fleet has no MIG device ({wanted}) this request accepts; "
                "the constraints name what was asked for and select only nodes that have it"
            )
    constraints.terms = terms
    return constraints


def _mig_choices(
    request: DeployRequest, fleet: Sequence[KnownGpu], min_memory_mib: int | None
) -> list[MigChoice]:
    """The known fleet's MIG devices the request accepts (profile, memory, model), smallest first."""
    profiles = set(request.mig_profiles)
    choices = [
        MigChoice(gpu.name, known.profile, known.memory_mib, known.multiprocessors)
        for gpu in fleet
        for known in gpu.mig_profiles
        if (not profiles or known.profile in profiles)
        and (min_memory_mib is None or known.memory_mib >= min_memory_mib)
        and (not request.gpu_models or any(matches_model(gpu.name, wanted) for wanted in request.gpu_models))
    ]
    return sorted(choices, key=lambda choice: (sort_key(choice.profile), choice.product))


def _inferred_terms(gpu: GpuFacts, platform: str, result: Constraints, rule: Rule) -> list[Term]:
    """placement.cuda_needs's rules for the CUDA an image carries: the driver floor of that CUDA, and the
    compute capabilities its GPU code runs on (`placement.gpu_code`; PTX JIT adds a floor)."""
    common: list[Term] = TRUE
    cuda = gpu.inferred.cuda if gpu.inferred is not None else None
    floor = cuda_needs.driver_floor(cuda) if cuda else None
    if floor is not None:
        version = parse_version(floor[0])
        assert version is not None
        common = [Term((("driver", Interval(low=Bound(version, True))),))]
        result.note(f"{platform}: {floor[1]} (CUDA {cuda} found in the layers)")
    ranges = cuda_needs.compute_capability_ranges(gpu, rule)
    if ranges is None:
        return common
    alternatives = []
    for low, high, ptx_floor in ranges:
        facts: list[tuple[str, Interval]] = [
            ("cc", Interval(low=Bound(low, True), high=None if high is None else Bound(high, True)))
        ]
        if ptx_floor is not None:
            version = parse_version(ptx_floor)
            assert version is not None
            facts.append(("driver", Interval(low=Bound(version, True))))
        alternatives.append(Term(tuple(facts)))
    if not alternatives:
        result.note(f"{platform}: no known compute capability runs the image's GPU code (placement.gpu_code)")
    return conjunction(common, alternatives)


def _brand_terms(
    requirements: ImageRequirements, fleet: Sequence[KnownGpu], platform: str, result: Constraints
) -> list[Term]:
    """The requirement's terms, with brand clauses turned into the fleet's products of that brand.

    Every node must pass for each name its runtime may report for the GPU's brand (placement's
    rule: current libnvidia-container, and older builds' `Unknown` for newer brands). A node whose
    product the fleet has not reported must pass whatever its brand is.
    """
    try:
        by_key: dict[tuple[bool, ...], list[Term]] = {}

        def for_brand(brand: str) -> list[Term]:
            key = _brand_key(requirements, brand)
            if key not in by_key:
                by_key[key] = _requirement_terms(requirements, brand)
            return by_key[key]

        every_brand = TRUE
        for brand in ALL_BRANDS:
            every_brand = conjunction(every_brand, for_brand(brand))
        if len(by_key) == 1:
            return every_brand  # brand clauses, if any, cover every brand: dropped
        groups: dict[tuple[str, ...], list[str]] = {}
        for gpu in fleet:
            groups.setdefault(runtime_brands(gpu.brand) or ("",), []).append(gpu.name)
        # Products whose brands give the same extra terms share those terms (one product list).
        extra_products: dict[Term, set[str]] = {}
        for names, products in groups.items():
            group_terms = TRUE
            for name in names:
                group_terms = conjunction(group_terms, for_brand(name))
            extra = [t for t in group_terms if not any(u.contains(t) for u in every_brand)]
            for term in extra:
                extra_products.setdefault(term, set()).update(products)
            if extra:
                result.brand_products.setdefault(names[0] or "unknown", []).extend(sorted(products))
        terms = list(every_brand)
        terms.extend(replace(term, products=frozenset(products)) for term, products in extra_products.items())
        if result.brand_products:
            listed = "; ".join(
                f"{brand}: {', '.join(names)}" for brand, names in result.brand_products.items()
            )
            result.note(
                f"{platform}: no scheduler label carries the GPU brand; brand clauses became the products "
                f"the known fleet reports with that brand ({listed}); other products must satisfy the "
                "requirement whatever their brand"
            )
        return disjunction(terms)
    except _TooComplex:
        result.note(
            f"{platform}: the requirement expands to more than {MAX_TERMS} alternatives; only the "
            "alternatives every brand passes are kept"
        )
        return FALSE


def _request_terms(request: DeployRequest, fleet: Sequence[KnownGpu], result: Constraints) -> list[Term]:
    term = Term()
    if request.min_driver is not None:
        version = parse_version(request.min_driver)
        if version is not None:
            term = term & Term((("driver", Interval(low=Bound(version, True))),)) or term
    if request.min_compute_capability is not None:
        version = parse_version(request.min_compute_capability)
        if version is not None:
            term = term & Term((("cc", Interval(low=Bound(version, True))),)) or term
    if request.gpu_models:
        chosen = frozenset(
            gpu.name for gpu in fleet if any(matches_model(gpu.name, wanted) for wanted in request.gpu_models)
        )
        result.note(
            f"GPU models {', '.join(request.gpu_models)} became the products the known fleet reports "
            f"({', '.join(sorted(chosen)) or 'none'}); other products are not selected"
        )
        if not chosen:
            return FALSE
        restricted = term & Term(products=chosen)
        return [restricted] if restricted is not None else FALSE
    return [term]
