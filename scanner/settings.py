"""Scanner settings: environment (prefix GPUBADGE_), an optional TOML/YAML file, and defaults.

Secrets are `SecretStr` so they never show up in a repr, a log line or an error.
Precedence for a single value: explicit keyword arguments, then environment, then the config file,
then defaults. List and map settings merge instead (see `scanner.settings_merge`): the environment
adds entries, the file's stay, and an ambiguous merge is refused.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_origin
from urllib.parse import unquote

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, InitSettingsSource, NoDecode, SettingsConfigDict

from scanner.facts.platforms import PlatformPolicy, parse_platforms
from scanner.layers import limits
from scanner.problems import document_error, dotted, expected, lines_of
from scanner.settings_merge import Keyed, Layer, MergeKind, Origin, Source, merge_layers, shown

MiB = 1024 * 1024
CONFIG_ENV = "GPUBADGE_CONFIG"
# One walk reads each layer for every analysis under one set of bounds, so the deep scan's own
# bounds are gone; an operator who still sets one learns what to set instead.
RETIRED_SETTINGS = {
    "deep_scan_max_layer_bytes": "every layer read has the same bounds; set max_layer_bytes",
    "deep_scan_max_image_bytes": "every layer read has the same bounds; set max_image_bytes",
    "deep_scan_seconds": "every layer read has the same bounds; set max_scan_seconds",
    "deep_scan_max_ratio": "every layer read is bounded by max_inflation_ratio",
}


def default_db_path() -> Path:
    """Where every command keeps its SQLite store unless told otherwise (`GPUBADGE_DB`, `--db`):
    `$XDG_DATA_HOME/gpubadge/gpubadge.db`, by default `~/.local/share/gpubadge/gpubadge.db`."""
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "gpubadge" / "gpubadge.db"


def sqlite_file_problem(text: str) -> str | None:
    """Why `text` cannot name a SQLite store, or None. A database URL where a file is asked for
    (`--db postgresql://…`) would otherwise become a file named after the URL, and every report a
    command stores would land in it unseen. The message never echoes `text`: a URL may hold a password."""
    if "://" in text:
        return "a URL is not a SQLite file; PostgreSQL is named by GPUBADGE_DATABASE_URL"
    return None


def sqlite_file_argument(text: str) -> Path:
    """The argparse type of every command's `--db`: a file name, never a URL (a usage error that
    names the option, exit 2)."""
    import argparse

    problem = sqlite_file_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return Path(text)


def default_docker_config() -> Path:
    """`$DOCKER_CONFIG/config.json` when set, as the Docker CLI does; else `~/.docker/config.json`."""
    directory = os.environ.get("DOCKER_CONFIG")
    if directory:
        return Path(directory) / "config.json"
    return Path.home() / ".docker" / "config.json"


class RegistryConfig(BaseModel):
    """Per-registry options. `host` is the registry name as in references (`docker.io`, `ghcr.io`)."""

    host: str
    username: str | None = None
    password: SecretStr | None = None
    token: SecretStr | None = Field(
        default=None, description="a pre-issued bearer token, sent as-is (no token exchange)"
    )
    insecure: bool = Field(default=False, description="allow plain HTTP to this host")
    mirror: str | None = Field(default=None, description="host[:port] tried first for this registry")
    push_username: str | None = Field(
        default=None, description="gpubadge's own account for attaching reports (GPUBADGE_ATTACH_REPORTS)"
    )
    push_password: SecretStr | None = Field(default=None, description="password or token for push_username")
    push_anonymous: bool = Field(
        default=False, description="attach reports without credentials (a registry open to anonymous pushes)"
    )

    def may_push(self) -> bool:
        """Reports are attached only where gpubadge was given its own way in (or told none is needed)."""
        return bool(self.push_username and self.push_password) or self.push_anonymous


class EffectiveSetting(BaseModel):
    """One line of `gpubadge config`: a setting's effective value (secrets `[redacted]`) and its source."""

    name: str
    variable: str
    value: Any
    source: Source
    entries: dict[str, Source] = Field(
        default_factory=dict, description="for a list or map: each host, key or item's own source"
    )
    shadows_file: bool = Field(
        default=False, description="the environment replaced a different value from the file"
    )


class ScannerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUBADGE_", env_nested_delimiter="__", extra="ignore")
    # Lists of entries that merge across sources by a key field rather than by position.
    MERGE_KEYS: ClassVar[dict[str, str]] = {"registries": "host"}
    _origins: dict[str, Origin] = PrivateAttr(default_factory=dict)
    _config_file: Path | None = PrivateAttr(default=None)

    registries: Annotated[list[RegistryConfig], NoDecode] = Field(
        default_factory=list,
        description="allowed registries: host[:port],... or a JSON list of {host, mirror, insecure, ...}",
    )
    docker_config: Path | None = Field(
        default_factory=default_docker_config,
        description="Docker client config for credentials (auths, credsStore, credHelpers); default $DOCKER_CONFIG/config.json or ~/.docker/config.json",
    )
    max_manifest_bytes: int = Field(default=4 * MiB, ge=1, description="largest manifest or index read")
    max_config_bytes: int = Field(default=8 * MiB, ge=1, description="largest image config read")
    max_layer_bytes: int = Field(
        default=limits.DEFAULT_MAX_LAYER_BYTES,
        ge=1,
        description="decompressed bytes of one layer (CUDA layers inflate to several GB)",
    )
    max_layers: int = Field(default=limits.DEFAULT_MAX_LAYERS, ge=1, description="layers per image")
    max_index_children: int = Field(
        default=limits.DEFAULT_MAX_INDEX_CHILDREN,
        ge=1,
        description="platform images of one index that a scan reads (attestations not counted); an index"
        " listing more fails naming this setting, for good",
    )
    max_path_bytes: int = Field(
        default=limits.DEFAULT_MAX_PATH_BYTES,
        ge=1,
        description="bytes in a layer entry's path or link target",
    )
    max_symlink_hops: int = Field(
        default=limits.DEFAULT_MAX_SYMLINK_HOPS,
        ge=1,
        description="symlinks followed per path; more is a loop, as in Linux (ELOOP)",
    )
    max_path_components: int = Field(
        default=limits.DEFAULT_MAX_PATH_COMPONENTS, ge=1, description="path components resolved per image"
    )
    max_layer_entries: int = Field(
        default=limits.DEFAULT_MAX_LAYER_ENTRIES, ge=1, description="tar entries per layer"
    )
    max_tar_header_bytes: int = Field(
        default=limits.DEFAULT_MAX_TAR_HEADER_BYTES,
        ge=1,
        description="bytes in one PAX or GNU extended header",
    )
    max_layer_records: int = Field(
        default=limits.DEFAULT_MAX_LAYER_RECORDS,
        ge=1,
        description="entries of one layer the libc analysis keeps (shells, loaders, library dirs, ELF heads)",
    )
    max_image_bytes: int = Field(
        default=limits.DEFAULT_MAX_IMAGE_BYTES, ge=1, description="decompressed bytes read per image"
    )
    max_inflation_ratio: int = Field(
        default=limits.DEFAULT_MAX_INFLATION_RATIO,
        ge=1,
        description="a layer inflating more than this many times its compressed size (past"
        " inflation_ratio_floor) is a decompression bomb; real layers inflate 2-5x",
    )
    inflation_ratio_floor: int = Field(
        default=limits.INFLATION_RATIO_FLOOR,
        ge=0,
        description="decompressed bytes of a layer never judged by its inflation ratio",
    )
    max_scan_seconds: float = Field(
        default=limits.DEFAULT_MAX_SCAN_SECONDS, gt=0, description="wall time per scan"
    )
    max_fatbin_containers: int = Field(
        default=limits.DEFAULT_MAX_FATBIN_CONTAINERS,
        ge=1,
        description="fatbin containers met in one file, and again walked over its fatbin sections",
    )
    max_fatbin_entries: int = Field(
        default=limits.DEFAULT_MAX_FATBIN_ENTRIES,
        ge=1,
        description="fatbin entry headers read in one file (each container's chain counted)",
    )
    max_cubin_symbols: int = Field(
        default=limits.DEFAULT_MAX_CUBIN_SYMBOLS,
        ge=1,
        description="cubin symbols read in one file to tell kernel-free containers",
    )
    max_layer_gpu_code_steps: int = Field(
        default=limits.DEFAULT_MAX_LAYER_GPU_CODE_STEPS,
        ge=1,
        description="fatbin containers, entry headers and cubin symbols visited in one layer; past it the"
        " GPU code of the layer's later files is not read (the report says so)",
    )
    analysis_processes: int = Field(
        default=2,
        ge=0,
        description="processes that parse layer content off the event loop; 0 parses in the scanning process",
    )
    inline_analysis_bytes: int = Field(
        default=limits.DEFAULT_INLINE_ANALYSIS_BYTES,
        ge=0,
        description="an image whose cache entries and layers still to read come to at most this many bytes"
        " (compressed layers counted 4x) is analysed in the scanning process, not handed to an analysis"
        " process; past this many bytes taken or decompressed, or inline_analysis_ms of CPU, its analysis"
        " starts over in one; 0: never",
    )
    inline_analysis_ms: float = Field(
        default=limits.DEFAULT_INLINE_ANALYSIS_MS,
        gt=0,
        description="CPU milliseconds an inline analysis (inline_analysis_bytes) may spend on the scanning"
        " process's event loop before it starts over in an analysis process",
    )
    analysis_memory_bytes: int = Field(
        default=limits.DEFAULT_ANALYSIS_MEMORY_BYTES,
        ge=0,
        description="address space of each analysis process (RLIMIT_AS); a layer whose analysis needs more"
        " fails naming this setting, and is not retried; 0: no limit",
    )
    deep_scan: Literal["always", "auto", "never"] = Field(
        default="always",
        description="which images' layers are read whole for the CUDA and GPU code they carry (torch, NVIDIA"
        " wheels, conda, toolkit trees, fatbins), in the same walk that finds the libc, each layer once ever"
        " (cached by digest): always = every image (default); auto = only images that declare no NVIDIA"
        " signal (a declared image's walk stops at its libc verdict, usually in the top layer's first KiB);"
        " never = the libc verdict only",
    )
    gpu_code_rule: Literal["dispatch", "strict"] = Field(
        default="dispatch",
        description="how placement judges an image's GPU code: dispatch = as packages load it (a library runs"
        " where some of its kernels do; extensions for other GPUs and optional packages are named, not"
        " refused); strict = every kernel of the image's own code must run on the GPU (one application's"
        " own kernels). A request's gpu_code_rule overrides it",
    )
    platforms: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="platforms whose layers are read: os/arch[/variant],... or `all` (linux only);"
        " default linux/amd64, linux/arm64 and every architecture a known server reports",
    )
    concurrency_per_registry: int = Field(
        default=8, ge=1, description="HTTP requests in flight to one registry"
    )
    request_timeout: float = Field(
        default=30.0, gt=0, description="seconds per request (per read for streams)"
    )
    retries: int = Field(default=4, ge=1, description="attempts per request, including the first")
    backoff_base: float = Field(default=0.5, ge=0, description="seconds before the first retry; doubles")
    backoff_max: float = Field(default=8.0, ge=0, description="longest wait between retries, in seconds")
    retry_after_max: float = Field(
        default=60.0, ge=0, description="longest Retry-After we wait; longer ones fail as RateLimited"
    )
    min_transfer_rate: int = Field(
        default=16 * 1024,
        ge=0,
        description="bytes per second a manifest or blob read must average over min_transfer_window; a slower"
        " one is cut off and its scan retried later (0: never cut off)",
    )
    min_transfer_window: float = Field(
        default=30.0,
        gt=0,
        description="seconds of waiting on a registry over which min_transfer_rate is judged",
    )
    max_redirects: int = Field(default=5, ge=0, description="redirects followed per request (blob CDNs)")
    redirect_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="hosts a registry's redirect may lead to besides the registries, their mirrors and the"
        " well-known storage of public registries: host[:port] or .domain (with its subdomains),...",
    )
    credential_helper_timeout: float = Field(
        default=10.0, gt=0, description="seconds a docker-credential-* helper may take"
    )
    docker_mirror: str | None = Field(default=None, description="host[:port] of a Docker Hub mirror")
    attach_reports: bool = Field(
        default=False,
        description="push each new report to the registry as an OCI referrer of the scanned manifest",
    )
    attach_attempts: int = Field(
        default=8,
        ge=1,
        description="tries per report attachment before giving up (8 with the default backoff: ~4 min)",
    )
    attach_backoff: float = Field(
        default=2.0, ge=0, description="seconds before the first attach retry; doubles"
    )
    attach_queue_max: int = Field(
        default=1000, ge=1, description="report attachments waiting at once; more are dropped and counted"
    )
    attach_nfd: bool = Field(
        default=True,
        description="with attach_reports, also attach Node Feature Discovery's image-compatibility artifact to"
        " GPU images (false: reports only)",
    )
    # Bounds on reading and evaluating an NFD image-compatibility document (anyone may attach one):
    # far above any real document (gpubadge's own is ~60 YAML nodes), far below what stalls.
    nfd_max_nodes: int = Field(
        default=20_000,
        ge=1,
        description="most YAML nodes an NFD document may expand to (aliases counted each use)",
    )
    nfd_max_depth: int = Field(default=64, ge=1, description="deepest nesting of an NFD document")
    nfd_max_feature_nodes: int = Field(
        default=1_000_000,
        ge=1,
        description="most YAML nodes a node-features file (gpubadge compat --node) may expand to",
    )
    nfd_regex_max_mem: int = Field(
        default=1 * MiB, ge=64 * 1024, description="RE2 memory for one InRegexp pattern of an NFD document"
    )
    nfd_regex_budget: int = Field(
        default=400_000,
        ge=1,
        description="RE2 instructions all the InRegexp patterns of one NFD evaluation may compile to",
    )
    nfd_max_evaluations: int = Field(
        default=500_000,
        ge=1,
        description="expressions (each on one feature element) one NFD evaluation of one node may run",
    )
    nfd_max_template_bytes: int = Field(
        default=64 * 1024, ge=1, description="largest expansion of one NFD varsTemplate"
    )
    nfd_cache_bytes: int = Field(
        default=16 * MiB,
        ge=0,
        description="memory the service keeps for NFD artifacts read back for the image page (parsed, not raw)",
    )

    @field_validator("redirect_hosts", mode="before")
    @classmethod
    def _hosts_from_text(cls, value: Any) -> Any:
        """`GPUBADGE_REDIRECT_HOSTS=storage.internal:9000,.blob.example.com`, or a list."""
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("analysis_memory_bytes")
    @classmethod
    def _room_to_start(cls, value: int) -> int:
        """An analysis process needs about 45 MB of address space before it reads anything."""
        if 0 < value < limits.MIN_ANALYSIS_MEMORY_BYTES:
            raise ValueError(f"must be 0 (no limit) or at least {limits.MIN_ANALYSIS_MEMORY_BYTES:,} bytes")
        return value

    @field_validator("platforms", mode="before")
    @classmethod
    def _platforms_from_text(cls, value: Any) -> Any:
        """`GPUBADGE_PLATFORMS=linux/amd64,linux/arm64`, `all`, or a list; each entry checked."""
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, list):
            parse_platforms([str(item) for item in value])  # raises ValueError naming the bad entry
        return value

    @model_validator(mode="before")
    @classmethod
    def _refuse_retired(cls, values: Any) -> Any:
        """Settings that no longer exist fail loudly, naming what replaced them, never silently."""
        named = set(values) if isinstance(values, dict) else set()
        named |= {key[len("GPUBADGE_") :].lower() for key in os.environ if key.startswith("GPUBADGE_")}
        for old, new in RETIRED_SETTINGS.items():
            if old in named:
                raise ValueError(f"setting {old} (GPUBADGE_{old.upper()}) was removed: {new}")
        return values

    @field_validator("registries", mode="before")
    @classmethod
    def _registries_from_text(cls, value: Any) -> Any:
        """`GPUBADGE_REGISTRIES=a,b:5000` or a JSON list; bare host strings inside a list too."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(
                        f"registries: not a JSON list ({exc.msg} at column {exc.colno})"
                    ) from None
            else:
                value = [host.strip() for host in text.split(",") if host.strip()]
        if isinstance(value, list):
            return [{"host": item} if isinstance(item, str) else item for item in value]
        return value

    def inline_budget(self) -> limits.InlineBudget | None:
        """What an image's analysis may cost in the scanning process (None: never analysed there)."""
        if self.inline_analysis_bytes <= 0:
            return None
        return limits.InlineBudget(self.inline_analysis_bytes, self.inline_analysis_ms / 1000)

    def analysis_limits(self) -> limits.AnalysisLimits:
        """The content bounds, as the analysis (possibly in another process) needs them."""
        return limits.AnalysisLimits(
            **{name: getattr(self, name) for name in limits.AnalysisLimits.model_fields}
        )

    def platform_policy(self) -> PlatformPolicy:
        """Which platforms get layer analysis, before the fleet's architectures are added."""
        return PlatformPolicy(tuple(self.platforms))

    def registry_config(self, host: str) -> RegistryConfig | None:
        """The configured entry for a registry name or API host, if any."""
        for entry in self.registries:
            if entry.host == host:
                return entry
        return None

    def is_insecure(self, host: str) -> bool:
        entry = self.registry_config(host)
        return bool(entry and entry.insecure)

    def mirror_for(self, registry: str) -> str | None:
        """The mirror's `host[:port]` for `registry` (scheme and user info dropped), if any."""
        entry = self.registry_config(registry)
        if entry and entry.mirror:
            return mirror_parts(entry.mirror)[0]
        if registry == "docker.io" and self.docker_mirror:
            return mirror_parts(self.docker_mirror)[0]
        return None

    def _mirrors(self) -> list[str]:
        """Every configured mirror setting, as written (the registries' and docker_mirror)."""
        mirrors = [entry.mirror for entry in self.registries if entry.mirror]
        if self.docker_mirror:
            mirrors.append(self.docker_mirror)
        return mirrors

    def mirror_hosts(self) -> set[str]:
        """Every configured mirror's `host[:port]`."""
        return {mirror_parts(mirror)[0] for mirror in self._mirrors()}

    def configured_hosts(self) -> set[str]:
        """The configured registries and every mirror: the hosts a token realm or a redirect may name."""
        return {entry.host for entry in self.registries} | self.mirror_hosts()

    def mirror_credentials(self, host: str) -> tuple[str, SecretStr] | None:
        """The user and password written into a mirror's URL (`https://user:password@host`), if any."""
        for mirror in self._mirrors():
            mirror_host, userinfo = mirror_parts(mirror)
            if mirror_host == host and userinfo is not None:
                user, _, password = userinfo.partition(":")
                return unquote(user), SecretStr(unquote(password))
        return None

    @classmethod
    def merge_kinds(cls) -> dict[str, MergeKind]:
        """How each list or map setting merges across sources (every other setting is one value)."""
        kinds: dict[str, MergeKind] = {}
        for name, info in cls.model_fields.items():
            origin = get_origin(info.annotation)
            if origin is dict:
                kinds[name] = "map"
            elif origin is list:
                kinds[name] = Keyed(cls.MERGE_KEYS[name]) if name in cls.MERGE_KEYS else "set"
        return kinds

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> ScannerSettings:
        """Settings validated from `values` alone: the environment is not read."""
        return cls(_build_sources=((InitSettingsSource(cls, init_kwargs=values),), values))

    @classmethod
    def load(cls, path: Path | None = None, **overrides: Any) -> ScannerSettings:
        """Settings from `path` (or $GPUBADGE_CONFIG) and the environment, merged by the rule of
        `scanner.settings_merge`; keyword overrides (command-line options) win over both.

        Raises ValueError (`SettingsConflict` for an ambiguous merge) naming the sources, never a value.
        """
        if path is None and os.environ.get(CONFIG_ENV):
            path = Path(os.environ[CONFIG_ENV])
        file_values, text, section = _read_config(path) if path else ({}, None, None)
        try:
            from_file = cls.from_values(file_values)
        except ValidationError as exc:
            raise SettingsError(f"config file {path}", exc, text, section) from None
        try:
            from_env = cls()
        except ValidationError as exc:
            raise SettingsError("the environment", exc) from None
        file_label = f"the file {path}"
        values, origins = merge_layers(
            cls.merge_kinds(),
            Layer(
                "file", {n: getattr(from_file, n) for n in from_file.model_fields_set}, lambda _: file_label
            ),
            Layer("environment", {n: getattr(from_env, n) for n in from_env.model_fields_set}, _env_label),
        )
        for name, value in overrides.items():
            values[name] = value
            origins[name] = Origin("command line")
        try:
            settings = cls.from_values(values)
        except ValidationError as exc:
            raise SettingsError("the merged settings", exc) from None
        settings._origins, settings._config_file = origins, path
        return settings

    def config_file(self) -> Path | None:
        """The settings file `load` read, if any."""
        return self._config_file

    def origin(self, name: str) -> Origin:
        """Where setting `name` came from (`default` when no source set it, or not loaded by `load`)."""
        return self._origins.get(name, Origin("default"))

    def effective(self) -> list[EffectiveSetting]:
        """Every setting's value, secrets `[redacted]`, with its source: what `gpubadge config` prints."""
        rows = []
        for name in type(self).model_fields:
            origin = self.origin(name)
            rows.append(
                EffectiveSetting(
                    name=name,
                    variable=f"GPUBADGE_{name.upper()}",
                    value=shown(getattr(self, name)),
                    source=origin.source,
                    entries=dict(origin.entries),
                    shadows_file=origin.shadows,
                )
            )
        return rows


def _env_label(name: str) -> str:
    """The environment variables that set `name` (`GPUBADGE_X`, or `GPUBADGE_X__KEY` for one entry)."""
    exact = f"GPUBADGE_{name.upper()}"
    found = sorted(key for key in os.environ if key.upper() == exact or key.upper().startswith(exact + "__"))
    return f"the environment ({', '.join(found) or exact})"


class SettingsError(ValueError):
    """Settings that do not validate, one problem per line: where (the file and its line and key,
    or the environment variable) and what was expected. Values are never echoed (secrets)."""

    def __init__(
        self, source: str, exc: ValidationError, text: str | None = None, section: str | None = None
    ) -> None:
        lines = []
        line_of = lines_of(text) if text else None  # the file parsed once, however many problems
        for error in exc.errors(include_url=False):
            loc = (section, *error["loc"]) if section else tuple(error["loc"])
            if source == "the environment":
                where = f"GPUBADGE_{str(error['loc'][0]).upper()}" if error["loc"] else source
            else:
                line = line_of(loc) if line_of else None
                where = f"{source}, {'line ' + str(line) + ', ' if line else ''}{dotted(loc)}"
            lines.append(f"{where}: {expected(error, show_input=False)}")
        super().__init__("; ".join(lines))


def read_config_file(path: Path) -> dict[str, Any]:
    """A TOML (`.toml`) or YAML file; a `[scanner]` table is used when present.

    A file that does not parse raises ValueError naming the file, the line and column and what is
    wrong there, never the line's content (it may be the `api_token` line): one line for the CLI
    to print, no traceback.
    """
    return _read_config(path)[0]


def _read_config(path: Path) -> tuple[dict[str, Any], str | None, str | None]:
    """The file's settings, its text (YAML only: to find a key's line), and "scanner" when they came from a `[scanner]` table.
    Raises ValueError naming the file (and the line, for a syntax error), never quoting its content."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"config file {path}: cannot read it: {exc.strerror or exc}") from None
    if path.suffix == ".toml":
        import tomllib  # deferred, as yaml: a run without a config file never parses one

        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            # tomllib's message is "<what> (at line L, column C)": no content of the file
            raise ValueError(f"config file {path}: not TOML: {exc}") from None
    else:
        import yaml  # deferred: only YAML config files need it

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"config file {path}: not YAML: {document_error(exc)}") from None
    located = None if path.suffix == ".toml" else text  # tomllib keeps no positions
    if data is None:
        return {}, located, None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a mapping at the top level")
    section = data.get("scanner", data)
    if not isinstance(section, dict):
        raise ValueError(f"config file {path}: 'scanner' must be a mapping")
    return section, located, "scanner" if "scanner" in data else None


def mirror_parts(mirror: str) -> tuple[str, str | None]:
    """A mirror setting (`host[:port]`, `scheme://host[:port][/]`, either with `user:password@`)
    as its `host[:port]` and its user info. The host is what requests, slots and errors name, so a
    password written into the URL never reaches a request line, a log or an error."""
    rest = mirror.split("://", 1)[-1].rstrip("/")
    userinfo, at, host = rest.rpartition("@")
    return (host, userinfo) if at else (rest, None)


# GPUBADGE_ variables read besides the settings: by the programs (the settings file, the demo's
# directory) and by the project's own tooling (caches, the air-gapped image's base, the tests' and
# benches' switches). tests/test_config_file.py holds every name the repository mentions to a
# setting or one of these.
NOT_SETTINGS = frozenset({CONFIG_ENV, "GPUBADGE_DEMO_DIR", "GPUBADGE_CACHE"})
TOOLING_PREFIXES = (
    "GPUBADGE_BENCH_",
    "GPUBADGE_TEST_",
    "GPUBADGE_REQUIRE_",
    "GPUBADGE_WHEEL_",
    "GPUBADGE_PYPI_",
)
TOOLING_NAMES = frozenset({"GPUBADGE_PREFETCH", "GPUBADGE_BASE_SUITE", "GPUBADGE_DEBIAN_MIRROR"})


def unknown_variables(environ: Mapping[str, str], settings: Iterable[str]) -> list[str]:
    """A sentence for each GPUBADGE_ variable of `environ` that names none of `settings` (field
    names), nor an entry of one (`NAME__KEY`), nor a variable read besides them: a misspelt setting
    is otherwise ignored in silence. The nearest setting is named where one is near. Retired
    settings are not among them: loading the settings refuses those, naming their successor."""
    known = {f"GPUBADGE_{name.upper()}" for name in settings}
    skipped = known | {f"GPUBADGE_{name.upper()}" for name in RETIRED_SETTINGS} | NOT_SETTINGS | TOOLING_NAMES
    found = []
    for name in sorted(environ):
        if not name.startswith("GPUBADGE_") or name in skipped or name.startswith(TOOLING_PREFIXES):
            continue
        if name.split("__", 1)[0] in known:
            continue
        near = difflib.get_close_matches(name, sorted(known | NOT_SETTINGS), n=1, cutoff=0.75)
        hint = f" (did you mean {near[0]}?)" if near else ""
        found.append(f"{name} is not a gpubadge setting{hint}; it is ignored")
    return found
