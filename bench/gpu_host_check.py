"""Ground truth on a real NVIDIA GPU host: what gpubadge says against what the GPU does.

Run where an NVIDIA GPU and its driver (`nvidia-smi`), the CUDA toolkit (`nvcc`, `cuobjdump`) and
Debian's `docker-registry` are: `python -m bench.gpu_host_check [--out DIR] [--torch DIR]`. No
stand-in for the GPU, the driver or NVML: this is the check the test suite cannot make on a
machine without them. Four parts, each compared with NVIDIA's own answer:

1. **NVML, as the agent reads it** (`agent.nvml.read_nvml`, `agent.host.build_server`) against
   `nvidia-smi`: UUID, name, memory, compute capability, MIG mode, driver and CUDA versions.
2. **Kernels built for one architecture or another, run on this GPU.** `nvcc` builds one small
   program per target (SASS for this GPU's major or another, an `a` build, PTX older or newer than
   the GPU, fat binaries with and without this GPU's code); each is run here, and it either
   computes or fails with CUDA's "no kernel image is available" (run with CUDA's default lazy module
   loading, and again with `CUDA_MODULE_LOADING=EAGER`). The scanner's fatbin reader must list what
   `cuobjdump` lists, and `placement.gpu_code` must say "runs" exactly where it ran (where only PTX
   covers the GPU, with the driver floor of the toolkit that wrote it). `--prebuilt DIR` adds programs
   built by another toolkit (a newer nvcc from PyPI, with its libcudart): the driver side of the rules.
3. **The product's own path, end to end.** Each program becomes an image (a glibc base, CUDA 13's
   `libcudart.so.13`, the program), pushed over plain HTTP to a real registry that notifies a real
   `gpubadge serve`; the service scans it through the webhook. This host registers through the
   agent's own HTTP client with the facts NVML gave. `POST /api/eligibility` must list this host
   for the images that ran and reject it, with the reason, for those that did not.
4. **A real framework.** The PyTorch installed here (`--torch`, default: the one `python3` imports):
   the scanner reads every shared object of it and of the `nvidia` wheels beside it; its SASS and
   PTX are checked against `cuobjdump` (libtorch_cuda.so) and `torch.cuda.get_arch_list()`, the
   verdict for this GPU against a matrix product run on it, and the driver its CUDA runtime needs
   against this driver.

Where this host has no Docker engine, the registration declares the NVIDIA runtime mode (the only
stand-in, and the JSON says so). Prints one line per finding and writes `gpu_host_check.json` to
`--out`; exit status 0 when every comparison agreed, 1 when one did not, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from agent.host import build_server, detect_runtime_modes
from agent.nvml import NvmlFacts, read_nvml
from agent.service_client import ServiceClient
from fixtures.cuda_program import PROGRAM_SOURCE, TARGETS
from fixtures.oci import OCI_MANIFEST, Entry, ImageSpec, LayerSpec, LayoutWriter, file
from fixtures.registry import notification_endpoint, run_registry
from fixtures.service import run_service_process
from placement import gpu_code
from placement.cuda_needs import driver_floor, ptx_driver_floor
from placement.inventory import RuntimeMode
from scanner.layers.cuda_evidence import file_archs
from scanner.layers.cudaelf import ElfCudaProbe
from scanner.models import FileArchs, GpuArchs

HOST_NAME = "gpu-host"
SECRET = "gpu-host-check"
AGENT_TOKEN = "gpu-host-check-agent"
CHUNK = 1 << 20


@dataclass
class Report:
    """Every finding, and whether each comparison agreed."""

    findings: dict[str, Any] = field(default_factory=dict)
    disagreements: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        print(line, flush=True)

    def disagree(self, line: str) -> None:
        self.disagreements.append(line)
        self.say(f"DISAGREES: {line}")


def run(command: list[str], timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)


def tool(name: str) -> str:
    """The toolkit's `name` on PATH or under /usr/local/cuda/bin."""
    found = shutil.which(name) or shutil.which(name, path="/usr/local/cuda/bin")
    if found is None:
        raise SystemExit(f"gpu_host_check: {name} not found (on PATH or in /usr/local/cuda/bin)")
    return found


# ---- 1. NVML as the agent reads it, against nvidia-smi ----------------------------------------------

SMI_FIELDS = "index,uuid,name,memory.total,compute_cap,driver_version,mig.mode.current"


def smi_gpus() -> list[dict[str, str]]:
    output = run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"]).stdout
    keys = SMI_FIELDS.split(",")
    return [
        dict(zip(keys, (part.strip() for part in line.split(",")), strict=True))
        for line in output.splitlines()
    ]


def smi_cuda() -> str | None:
    found = re.search(r"CUDA Version:\s*([0-9]+\.[0-9]+)", run(["nvidia-smi"]).stdout)
    return found[1] if found else None


def check_nvml(report: Report) -> NvmlFacts:
    facts = read_nvml()
    smi = smi_gpus()
    cuda = smi_cuda()
    report.findings["nvml"] = {
        "driver_version": facts.driver_version,
        "cuda_driver_version": facts.cuda_driver_version,
        "gpus": [gpu.model_dump() for gpu in facts.gpus],
        "reason": facts.reason,
    }
    report.findings["nvidia_smi"] = {"gpus": smi, "cuda": cuda}
    report.say(
        f"NVML (agent): driver {facts.driver_version}, CUDA {facts.cuda_driver_version}, {len(facts.gpus)} GPU(s)"
    )
    if facts.reason:
        report.disagree(f"the agent found no usable GPU: {facts.reason}")
    if len(facts.gpus) != len(smi):
        report.disagree(f"NVML saw {len(facts.gpus)} GPUs, nvidia-smi {len(smi)}")
    if cuda != facts.cuda_driver_version:
        report.disagree(f"CUDA version: the agent {facts.cuda_driver_version}, nvidia-smi {cuda}")
    for gpu, row in zip(facts.gpus, smi, strict=False):
        mig = {"Enabled": True, "Disabled": False}.get(row["mig.mode.current"], False)
        pairs = {
            "uuid": (gpu.uuid, row["uuid"]),
            "name": (gpu.name, row["name"]),
            "memory MiB": (str(gpu.memory_mib), row["memory.total"]),
            "compute capability": (gpu.compute_capability, row["compute_cap"]),
            "driver": (facts.driver_version, row["driver_version"]),
            "MIG": (gpu.mig, mig),
        }
        report.say(
            f"  GPU {gpu.index}: {gpu.name}, {gpu.memory_mib} MiB, CC {gpu.compute_capability}, brand"
            f" {gpu.brand or '?'}, MIG {'on' if gpu.mig else 'off'}"
        )
        for what, (ours, theirs) in pairs.items():
            if ours != theirs:
                report.disagree(f"GPU {gpu.index} {what}: the agent says {ours!r}, nvidia-smi {theirs!r}")
    return facts


# ---- 2. kernels per target: run here, read by the scanner, judged by placement --------------------


@dataclass
class Kernel:
    name: str
    path: Path
    gencode: tuple[str, ...] = ()  # nvcc's -gencode arguments it was built with
    runtime: Path | None = None  # the libcudart it loads (None: the toolkit's)
    ran: bool = False  # with CUDA's default module loading (lazy)
    ran_eager: bool = False  # with CUDA_MODULE_LOADING=EAGER: every module loaded at start
    output: str = ""
    cuobjdump: tuple[list[str], list[str]] = field(default_factory=lambda: ([], []))
    archs: FileArchs | None = None


def cudart_library() -> Path:
    """CUDA's shared runtime as the toolkit installed it (what `-cudart shared` programs load)."""
    nvcc = Path(tool("nvcc")).resolve()
    for directory in (nvcc.parent.parent / "lib64", nvcc.parent.parent / "targets/x86_64-linux/lib"):
        found = sorted(directory.glob("libcudart.so.[0-9]*.*"))
        if found:
            return found[-1]
    raise SystemExit("gpu_host_check: no libcudart.so beside nvcc")


def build(workdir: Path) -> list[Kernel]:
    source = workdir / "probe.cu"
    source.write_text(PROGRAM_SOURCE)
    nvcc = tool("nvcc")

    def one(name: str) -> Kernel | None:
        out = workdir / name
        command = [nvcc, "-O2", "-cudart", "shared", "-o", str(out), str(source)]
        for target in TARGETS[name]:
            command[1:1] = ["-gencode", target]
        done = run(command)
        if done.returncode != 0:
            print(f"  {name}: nvcc refused ({done.stderr.strip().splitlines()[-1:]}), left out", flush=True)
            return None
        return Kernel(name, out, gencode=TARGETS[name])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        built = list(pool.map(one, TARGETS))
    return [kernel for kernel in built if kernel is not None]


def cuobjdump_archs(path: Path) -> tuple[list[str], list[str]]:
    """(SASS archs, PTX archs) as `cuobjdump --list-elf --list-ptx` names them (sm_XY[a|f])."""
    output = run([tool("cuobjdump"), "--list-elf", "--list-ptx", str(path)], timeout=600).stdout
    sass = sorted({m[1] for m in re.finditer(r"\.(sm_\d+[af]?)\.cubin", output)})
    ptx = sorted({m[1] for m in re.finditer(r"\.(sm_\d+[af]?)\.ptx", output)})
    return sass, ptx


def read_archs(path: Path, shown_as: str) -> FileArchs | None:
    """The scanner's reading of one file, streamed in chunks as the layer walk feeds it."""
    size = path.stat().st_size
    probe = ElfCudaProbe(size)
    with path.open("rb") as stream:
        while chunk := stream.read(CHUNK):
            if not probe.feed(chunk):
                break
    facts = probe.finish()
    return None if facts is None else file_archs(shown_as, facts)


def as_sm(archs: list[str]) -> list[str]:
    """The scanner's arch names ("90a", "compute_90") in cuobjdump's spelling ("sm_90a")."""
    return sorted({"sm_" + arch.removeprefix("sm_").removeprefix("compute_") for arch in archs})


def family_as_listed(archs: tuple[list[str], list[str]]) -> tuple[list[str], list[str]]:
    """`cuobjdump --list-elf` (13.0 and 13.5) names a family cubin (`sm_100f`, flag 0x200000 in its
    fatbin entry) by its base arch (`sm_100`); the scanner keeps the `f`. Compared in cuobjdump's
    spelling; the rules give both the same answer on every GPU NVIDIA lists."""
    sass, ptx = ({re.sub(r"(sm_\d+)f$", r"\1", arch) for arch in part} for part in archs)
    return sorted(sass), sorted(ptx)


def prebuilt(directory: Path) -> list[Kernel]:
    """Programs built elsewhere (another nvcc): `programs.json` maps each file's name to the
    -gencode list and the toolkit that built it; the `libcudart.so.*` beside them is what they load."""
    listing = json.loads((directory / "programs.json").read_text())
    runtime = next(iter(sorted(directory.glob("libcudart.so.*"))), None)
    return [
        Kernel(name, directory / name, gencode=tuple(built["gencode"]), runtime=runtime)
        for name, built in listing.items()
    ]


def driver_allows(driver: str | None, floor: tuple[str, str] | None) -> bool:
    return floor is None or driver is None or gpu_code.version_key(driver) >= gpu_code.version_key(floor[0])


def check_kernels(
    report: Report, workdir: Path, cc: tuple[int, int], driver: str | None, extra: Path | None
) -> list[Kernel]:
    report.say(f"kernels: building {len(TARGETS)} targets with {tool('nvcc')}")
    kernels = build(workdir) + (prebuilt(extra) if extra else [])
    toolkit_runtime = cudart_library()
    rows = []
    for kernel in kernels:
        runtime_dir = str((kernel.runtime or toolkit_runtime).parent)
        env = {**os.environ, "LD_LIBRARY_PATH": runtime_dir + ":" + os.environ.get("LD_LIBRARY_PATH", "")}
        done = run([str(kernel.path)], timeout=120, env=env)
        kernel.output = (done.stdout + done.stderr).strip()
        kernel.ran = done.returncode == 0 and "ran: 42" in done.stdout
        eager = run([str(kernel.path)], timeout=120, env={**env, "CUDA_MODULE_LOADING": "EAGER"})
        kernel.ran_eager = eager.returncode == 0 and "ran: 42" in eager.stdout
        if kernel.ran_eager != kernel.ran:
            report.say(
                f"  {kernel.name}: with eager module loading {(eager.stdout + eager.stderr).strip()!r}"
            )
        kernel.cuobjdump = cuobjdump_archs(kernel.path)
        kernel.archs = read_archs(kernel.path, f"/app/{kernel.name}")
        ours = (as_sm(kernel.archs.sass), as_sm(kernel.archs.ptx)) if kernel.archs else ([], [])
        verdict = gpu_code.judge_file(kernel.archs, cc) if kernel.archs else None
        # where PTX must be JIT-compiled here, the driver must know its ISA (placement.cuda_needs)
        jit_floor = ptx_driver_floor(verdict.ptx_isa) if verdict else None
        says_runs = bool(verdict and verdict.runs) and driver_allows(driver, jit_floor)
        report.say(
            f"  {kernel.name}: {'ran' if kernel.ran else kernel.output!r}; cuobjdump SASS"
            f" {','.join(kernel.cuobjdump[0]) or '-'} PTX {','.join(kernel.cuobjdump[1]) or '-'};"
            f" placement: {'runs' if says_runs else 'does not run'} on {cc[0]}.{cc[1]}"
        )
        if family_as_listed(ours) != kernel.cuobjdump:
            report.disagree(f"{kernel.name}: the scanner read {ours}, cuobjdump lists {kernel.cuobjdump}")
        if says_runs != kernel.ran:
            report.disagree(
                f"{kernel.name}: placement says {'runs' if says_runs else 'does not run'}, the GPU: {kernel.output!r}"
            )
        rows.append(
            {
                "name": kernel.name,
                "gencode": kernel.gencode,
                "ran": kernel.ran,
                "ran_eager": kernel.ran_eager,
                "output": kernel.output,
                "cuobjdump": {"sass": kernel.cuobjdump[0], "ptx": kernel.cuobjdump[1]},
                "scanner": {"sass": ours[0], "ptx": ours[1]},
                "placement_runs": says_runs,
                "placement_ptx_isa": verdict.ptx_isa if verdict else None,
                # the driver a JIT of that PTX needs (placement checks it against each server's driver)
                "placement_ptx_driver_floor": jit_floor,
            }
        )
    report.findings["kernels"] = rows
    return kernels


# ---- 3. the product's path: registry -> webhook -> scan -> agent registration -> eligibility ------


def push_layout(layout: Path, descriptor: dict[str, Any], registry: str, repository: str, tag: str) -> None:
    """Push one image of an OCI layout over the distribution API (monolithic blob uploads), with
    urllib: a client independent of the scanner's."""
    blobs = layout / "blobs" / "sha256"
    manifest = (blobs / descriptor["digest"].removeprefix("sha256:")).read_bytes()
    parsed = json.loads(manifest)
    for blob in [parsed["config"], *parsed["layers"]]:
        data = (blobs / blob["digest"].removeprefix("sha256:")).read_bytes()
        start = urllib.request.Request(f"http://{registry}/v2/{repository}/blobs/uploads/", method="POST")
        with urllib.request.urlopen(start, timeout=60) as answer:
            location = urllib.parse.urljoin(f"http://{registry}", answer.headers["Location"])
        joiner = "&" if "?" in location else "?"
        put = urllib.request.Request(
            f"{location}{joiner}digest={urllib.parse.quote(blob['digest'])}",
            data=data,
            method="PUT",
            headers={"Content-Type": "application/octet-stream"},
        )
        urllib.request.urlopen(put, timeout=120).close()
    put = urllib.request.Request(
        f"http://{registry}/v2/{repository}/manifests/{tag}",
        data=manifest,
        method="PUT",
        headers={"Content-Type": OCI_MANIFEST},
    )
    urllib.request.urlopen(put, timeout=60).close()


def base_entries() -> list[Entry]:
    """This host's glibc as an image's base layer carries it (the scanner reads the libc flavour)."""
    entries = []
    for path in ("/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libc.so.6"):
        real = Path(path).resolve()
        entries.append(file(path.lstrip("/"), real.read_bytes(), 0o755))
    return entries


def runtime_modes() -> tuple[list[RuntimeMode], bool]:
    """The NVIDIA modes this host's Docker engine offers, else the runtime mode declared (stand-in)."""
    with contextlib.suppress(Exception):
        import docker

        modes = detect_runtime_modes(docker.from_env(timeout=5).info())
        if modes:
            return modes, False
    return ["runtime"], True


async def product_path(report: Report, facts: NvmlFacts, kernels: list[Kernel], workdir: Path) -> None:
    base = LayerSpec(base_entries())
    runtimes: dict[Path, LayerSpec] = {}

    def runtime_layer(cudart: Path) -> LayerSpec:
        """The CUDA runtime a program loads, where an image built from the toolkit puts it."""
        if cudart not in runtimes:
            soname = "libcudart.so." + cudart.name.split(".so.")[1].split(".")[0]
            runtimes[cudart] = LayerSpec([file(f"usr/local/cuda/lib64/{soname}", cudart.read_bytes(), 0o755)])
        return runtimes[cudart]

    env = {
        "GPUBADGE_WEBHOOK_SECRET": SECRET,
        "GPUBADGE_DEEP_SCAN": "always",
        "GPUBADGE_AGENT_TOKEN": AGENT_TOKEN,
    }
    with run_service_process(workdir / "gpubadge.db", env=env, log_path=workdir / "service.log") as service:
        hook = notification_endpoint(f"{service.url}/hooks/distribution", SECRET, backoff="500ms")
        extra = {"notifications": {"endpoints": [hook]}}
        with run_registry(extra_config=extra, root=workdir / "registry") as registry:
            modes, declared = runtime_modes()
            server = build_server(HOST_NAME, facts, modes)
            async with aiohttp.ClientSession() as session:
                await ServiceClient(service.url, AGENT_TOKEN, session).register(server)
                report.findings["registration"] = {
                    "server": server.model_dump(mode="json"),
                    "runtime_modes_declared_stand_in": declared,
                }
                report.say(
                    f"product path: {HOST_NAME} registered through the agent's client"
                    f" ({'runtime mode declared: no Docker engine here' if declared else 'runtime modes from docker info'})"
                )
                layout = workdir / "layout"
                writer = LayoutWriter(layout)
                started = time.perf_counter()
                references = {}
                for kernel in kernels:
                    app = LayerSpec([file(f"app/{kernel.name}", kernel.path.read_bytes(), 0o755)])
                    spec = ImageSpec(
                        layers=[base, runtime_layer(kernel.runtime or cudart_library()), app],
                        env={
                            "NVIDIA_VISIBLE_DEVICES": "all",
                            "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
                        },
                        cmd=[f"/app/{kernel.name}"],
                    )
                    push_layout(layout, writer.image(spec), registry.host, f"probes/{kernel.name}", "1")
                    references[kernel.name] = f"{registry.host}/probes/{kernel.name}:1"
                report.say(f"  pushed {len(references)} images in {time.perf_counter() - started:.1f} s")
                rows = []
                for kernel in kernels:
                    reference = references[kernel.name]
                    query = urllib.parse.urlencode({"ref": reference, "wait": "60"})
                    async with session.get(f"{service.url}/api/images/by-ref?{query}") as answer:
                        scanned = await answer.json()
                        if answer.status != 200 or scanned.get("pending"):
                            report.disagree(
                                f"{reference}: no finished report in 60 s ({answer.status}: {scanned})"
                            )
                            continue
                    body = {"image": reference, "gpus": 1, "explain": "all"}
                    async with session.post(f"{service.url}/api/eligibility", json=body) as answer:
                        decided = await answer.json()
                    eligible = [item["server"] for item in decided.get("eligible", [])]
                    reasons = [
                        reason
                        for item in decided.get("ineligible", [])
                        if item.get("server") == HOST_NAME
                        for reason in item.get("reasons", [])
                    ]
                    listed = HOST_NAME in eligible
                    gpu = (scanned.get("platforms") or [{}])[0].get("gpu", {})
                    report.say(
                        f"  {kernel.name}: {'eligible' if listed else 'not eligible'}"
                        + ("" if listed else f" ({'; '.join(reasons)[:300]})")
                        + f"; the GPU {'ran it' if kernel.ran else 'did not'}"
                    )
                    if listed != kernel.ran:
                        report.disagree(
                            f"{kernel.name}: the service says {'eligible' if listed else 'not eligible'},"
                            f" the GPU {'ran it' if kernel.ran else 'did not'}"
                        )
                    rows.append(
                        {
                            "name": kernel.name,
                            "reference": reference,
                            "eligible": listed,
                            "reasons": reasons,
                            "ran": kernel.ran,
                            "report_gpu": gpu,
                        }
                    )
                report.findings["eligibility"] = rows


# ---- 4. a real framework -----------------------------------------------------------------------------

TORCH_FACTS = r"""
import json, os, time, torch
a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
torch.cuda.synchronize()
started = time.perf_counter()
b = a @ a
torch.cuda.synchronize()
print(json.dumps({
    "version": torch.__version__, "cuda": torch.version.cuda, "archs": torch.cuda.get_arch_list(),
    "device": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
    "matmul_ok": bool(torch.isfinite(b).all().item()), "dir": os.path.dirname(torch.__file__),
}))
"""


def check_torch(report: Report, cc: tuple[int, int], driver: str | None, torch_dir: Path | None) -> None:
    done = run([sys.executable, "-c", TORCH_FACTS], timeout=300)
    if done.returncode != 0:
        report.say(f"torch: not checked ({done.stderr.strip().splitlines()[-1:] or 'no torch here'})")
        report.findings["torch"] = {"skipped": done.stderr[-2000:]}
        return
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    root = torch_dir or Path(facts["dir"])
    site = root.parent
    files = sorted({*root.glob("lib/*.so*"), *site.glob("nvidia/**/lib/*.so*")}, key=lambda path: str(path))
    started = time.perf_counter()
    read = 0
    found: list[FileArchs] = []
    for path in files:
        if not path.is_file():
            continue
        read += path.stat().st_size
        archs = read_archs(path, str(path.relative_to(site)))
        if archs is not None:
            found.append(archs)
    seconds = time.perf_counter() - started
    verdict = gpu_code.judge(GpuArchs(files=found), cc)
    own = next((archs for archs in found if archs.path.endswith("libtorch_cuda.so")), None)
    report.say(
        f"torch {facts['version']} (CUDA {facts['cuda']}) on {facts['device']}: the scanner read {len(files)}"
        f" shared objects, {read / 2**30:.2f} GiB, in {seconds:.1f} s ({read / 2**20 / max(seconds, 1e-9):.0f} MiB/s),"
        f" {len(found)} with GPU code; placement: {'runs' if verdict.runs else 'does not run'} on"
        f" {cc[0]}.{cc[1]}; the matrix product {'ran' if facts['matmul_ok'] else 'failed'}"
    )
    findings: dict[str, Any] = {
        "torch": facts,
        "files_read": len(files),
        "bytes_read": read,
        "seconds": seconds,
        "files_with_gpu_code": len(found),
        "placement_runs": verdict.runs,
        "reasons": verdict.reasons,
        "caveats": verdict.caveats,
    }
    if verdict.runs != facts["matmul_ok"]:
        report.disagree(
            f"torch: placement says {'runs' if verdict.runs else 'does not run'}; the matrix product {'ran' if facts['matmul_ok'] else 'failed'}"
        )
    for caveat in verdict.caveats:
        report.say(f"  caveat: {caveat}")
    if own is not None:
        listed = cuobjdump_archs(root / "lib" / "libtorch_cuda.so")
        ours = (as_sm(own.sass), as_sm(own.ptx))
        torch_archs = sorted(arch for arch in facts["archs"] if arch.startswith("sm_"))
        findings["libtorch_cuda"] = {
            "scanner": {"sass": ours[0], "ptx": ours[1]},
            "cuobjdump": {"sass": listed[0], "ptx": listed[1]},
            "torch_arch_list": facts["archs"],
        }
        report.say(f"  libtorch_cuda.so: SASS {','.join(ours[0])}; PTX {','.join(ours[1]) or '-'}")
        if family_as_listed(ours) != listed:
            report.disagree(f"libtorch_cuda.so: the scanner read {ours}, cuobjdump lists {listed}")
        if ours[0] != torch_archs:  # the build's arch list, for the reader; cuobjdump is the ground truth
            report.say(f"  note: torch.cuda.get_arch_list() says {facts['archs']}")
    floor = driver_floor(facts["cuda"]) if facts.get("cuda") else None
    findings["driver_floor"] = floor
    if floor is not None and driver is not None:
        needed = floor[0]
        ok = gpu_code.version_key(driver) >= gpu_code.version_key(needed)
        report.say(
            f"  its CUDA {facts['cuda']} runtime needs driver >= {needed} ({floor[1]}); this driver {driver}"
        )
        if not ok:
            report.disagree(f"torch ran on driver {driver}, below the floor {needed} placement would require")
    report.findings["torch"] = findings


# ---- entry --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def workdir_at(out: Path) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gpu-host-check-"))
    try:
        yield path
    finally:
        for log in ("service.log",):
            with contextlib.suppress(OSError):
                shutil.copy(path / log, out / log)
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_host_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("."), help="where gpu_host_check.json goes")
    parser.add_argument(
        "--torch", type=Path, default=None, help="torch's package directory (default: python3's)"
    )
    parser.add_argument(
        "--prebuilt",
        type=Path,
        help="programs built by another nvcc (programs.json, the binaries, their libcudart)",
    )
    parser.add_argument("--skip", action="append", default=[], choices=["kernels", "product", "torch"])
    args = parser.parse_args(argv)
    if args.prebuilt is not None and not (args.prebuilt / "programs.json").is_file():
        parser.error(f"--prebuilt: no programs.json in {args.prebuilt}")
    # what this host must have, named before anything runs (a host without a GPU stops here)
    for name in ["nvidia-smi", *([] if "kernels" in args.skip else ["nvcc", "cuobjdump"])]:
        tool(name)
    if "product" not in args.skip and shutil.which("docker-registry") is None:
        raise SystemExit("gpu_host_check: docker-registry not found on PATH (or pass --skip product)")
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report()
    started = time.perf_counter()
    facts = check_nvml(report)
    if not facts.gpus:
        report.say("no GPU: nothing else to compare")
    else:
        major, _, minor = facts.gpus[0].compute_capability.partition(".")
        cc = (int(major), int(minor))
        with workdir_at(args.out) as workdir:
            kernels = (
                []
                if "kernels" in args.skip
                else check_kernels(report, workdir, cc, facts.driver_version, args.prebuilt)
            )
            if kernels and "product" not in args.skip:
                asyncio.run(product_path(report, facts, kernels, workdir))
            if "torch" not in args.skip:
                check_torch(report, cc, facts.driver_version, args.torch)
    report.findings["seconds"] = time.perf_counter() - started
    report.findings["disagreements"] = report.disagreements
    (args.out / "gpu_host_check.json").write_text(json.dumps(report.findings, indent=2, default=str))
    report.say(
        f"{len(report.disagreements)} disagreement(s) in {report.findings['seconds']:.0f} s;"
        f" {args.out / 'gpu_host_check.json'}"
    )
    return 1 if report.disagreements else 0


if __name__ == "__main__":
    raise SystemExit(main())
