"""Issue 45, the first hour: a fresh user's `make run` (its registry, fleet and sample images), met
through the CLI as a subprocess, over HTTP and in Chromium at 1280 and 400 px.

One answer to "does this image need a GPU?" (placement.image_needs: declared GPU, carried CUDA,
runs on a CPU too) in the list, the filters, the legend, the page, the JSON API, `gpubadge scan`
and the eligibility answer; the page's headline agrees with placement, brand exceptions included;
errors a newcomer can act on; pages that read well on a laptop and a phone.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.test_service_e2e import by_ref, call

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Demo:
    service: str
    registry: str
    tmp: Path

    def ref(self, name: str) -> str:
        return f"{self.registry}/samples/{name}"

    def get(self, path: str) -> str:
        reply = call("GET", self.service + path)
        assert reply.status == 200, (path, reply.status, reply.text[:500])
        return reply.text


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    """`make run` itself (fixtures.demo), up and showing its samples, for the whole module."""
    tmp = tmp_path_factory.mktemp("first-hour")
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPUBADGE")}
    # free ports for both listeners: the intake's default, 8081, is one port for the whole host, which
    # another test's service may hold (the demo then says so and exits)
    env |= {
        "GPUBADGE_PORT": "0",
        "GPUBADGE_INTAKE_PORT": "0",
        "TMPDIR": str(tmp),
        "PYTHONPATH": str(REPO_ROOT),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "fixtures.demo"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    ended = "(the demo exited)\n"

    def read() -> None:
        for line in process.stdout or ():
            lines.put(line)
        lines.put(ended)

    threading.Thread(target=read, daemon=True).start()
    printed = ""
    try:
        deadline = time.monotonic() + 240
        while "Ctrl-C to stop." not in printed:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line != ended, printed  # what it said before it stopped
            printed += line
        found = re.search(r"export GPUBADGE=(\S+) REGISTRY=(\S+)", printed)
        assert found, printed
        yield Demo(found.group(1), found.group(2), tmp)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """This checkout's `gpubadge`, as a user runs it."""
    full = {key: value for key, value in os.environ.items() if not key.startswith("GPUBADGE")}
    full |= {"PYTHONPATH": str(REPO_ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def eligibility(demo: Demo, image: str, **request: Any) -> dict[str, Any]:
    reply = call("POST", f"{demo.service}/api/eligibility", {"image": image, **request})
    assert reply.status == 200, reply.text
    body: dict[str, Any] = reply.body
    return body


# --- one answer to "does this image need a GPU?" -----------------------------------------------------


def test_an_image_that_carries_cuda_and_declares_none_has_one_answer_everywhere(
    demo: Demo, tmp_path: Path
) -> None:
    torch = demo.ref("pip-torch:2.3")  # torch cu121 in pip wheels, no NVIDIA variable
    # the JSON API: the listing row and the report say "optional", the carried CUDA and its driver
    listing = json.loads(demo.get("/api/images?q=pip-torch"))["images"]
    assert [(row["gpu"], row["carried_cuda"], row["gpu_required"]) for row in listing] == [
        ("optional", ["12.1"], False)
    ]
    needs = by_ref(demo.service, torch).body["needs"]
    assert (needs["gpu"], needs["runs_on_cpu"], needs["carried_cuda"], needs["driver_floor"]) == (
        "optional",
        True,
        ["12.1"],
        "525.60.13",
    )
    # the eligibility answer says the same, not "needs a GPU"
    answer = eligibility(demo, torch)
    assert (answer["image_gpu"], answer["image_needs_gpu"]) == ("optional", False)
    # the images list: "GPU optional", never "CPU only"; the CPU-only filter leaves it out
    row = re.search(r'<tr>\s*<td class="image-cell">.*?pip-torch.*?</tr>', demo.get("/"), re.S)
    assert (
        row
        and "GPU optional" in row.group()
        and "CPU only" not in row.group()
        and "CUDA 12.1 inside" in row.group()
    )
    assert "pip-torch" not in demo.get("/?gpu=cpu") and "pip-torch" in demo.get("/?gpu=optional")
    legend = demo.get("/").split('id="legend-title"', 1)[1]
    assert "GPU optional" in legend and "runs on a CPU" in legend
    # `gpubadge scan`: the table and --json, with the carried CUDA and the driver floor
    db = str(tmp_path / "cli.db")
    table = cli("scan", torch, "--db", db)
    assert table.returncode == 0, table.stderr
    header, line = table.stdout.splitlines()[:2]
    cells = dict(zip(header.split(), re.split(r"\s{2,}", line.strip()), strict=False))
    assert (cells["GPU"], cells["CUDA"], cells["DRIVER"]) == ("optional", "12.1 (carried)", ">=525.60.13"), (
        table.stdout
    )
    lines = cli("scan", torch, "--json", "--db", db)
    printed = json.loads(lines.stdout)["needs"]
    assert (printed["gpu"], printed["carried_cuda"], printed["driver_floor"]) == (
        "optional",
        ["12.1"],
        "525.60.13",
    )


def test_the_cuda_filter_matches_the_cuda_an_image_carries(demo: Demo) -> None:
    assert "pip-torch" in demo.get("/?cuda=12.1")  # its badge reads "CUDA 12.1 inside"
    newer = demo.get("/?cuda=12.4")  # declares 11.8, carries 12.4: needs a CUDA 12.4 driver floor
    assert "cuda-newer-inside" in newer and "multi-arch" in newer
    api = json.loads(demo.get("/api/images?cuda=12.1"))["images"]
    assert [image["repository"] for image in api] == ["samples/pip-torch"]


def test_the_image_page_headline_agrees_with_placement_brand_exceptions_included(demo: Demo) -> None:
    image = demo.ref("cuda-ubuntu:12.2")
    page = demo.get(f"/images/{image}")
    headline = re.search(r'<p class="answer-headline">(.*?)</p>', page, re.S)
    assert headline, page
    text = headline.group(1)
    assert "driver ≥ 535.54.03" in text and "driver 470 or 525 on" in text and "(brand exceptions)" in text
    link = f"/eligibility?{urllib.parse.urlencode({'image': image, 'gpus': '1'})}"
    assert f'href="{link.replace("&", "&amp;")}"' in page and "Where it can run" in page
    # Placement's own answer: every eligible server passes on a driver at least the headline's floor,
    # or through a brand exception the headline names, and says so.
    answer = eligibility(demo, image, gpus=1, explain="all")
    assert answer["eligible_count"] >= 2
    for server in answer["eligible"]:
        why = " ".join(server["why"])
        assert server["why"] and ("driver CUDA" in why or "brand exception" in why), server
        if "brand exception" in why:
            branch = re.search(r"in branch (\d+)", why)
            assert branch and f"{branch.group(1)}" in text, (why, text)
    summary = eligibility(demo, image, gpus=1)  # the paged answer says why too
    assert all(server["why"] for server in summary["eligible"])


def test_the_image_page_shows_where_it_runs_by_generation(demo: Demo) -> None:
    """Issue 42: a row per compute capability from 7.0 with runs / does not run, the driver and what
    decided it, agreeing with the headline's driver."""
    page = demo.get(f"/images/{demo.ref('cuda-ubuntu:12.2')}")
    table = re.search(r'<table class="generations">(.*?)</table>', page, re.S)
    assert table, page
    rows = re.findall(r'<tr class="gen-([a-z-]+)">\s*<th scope="row">([0-9.]+) ', table.group(1))
    assert [cc for _, cc in rows][:3] == ["7.0", "7.2", "7.5"] and rows[-1][1] == "12.1"
    assert all(status == "runs" for status, _ in rows)  # CUDA 12.2: no GPU code of its own to judge
    assert table.group(1).count("≥ 535.54.03") == len(rows)  # the headline's floor, on every row
    legacy = demo.get(f"/images/{demo.ref('legacy-cuda:10.0')}")
    assert '<table class="generations">' in legacy
    cpu = demo.get(f"/images/{demo.ref('plain-glibc:22.04')}")
    assert '<table class="generations">' not in cpu  # no GPU, no table


def test_eligible_servers_in_the_explorer_say_why(demo: Demo, browser: Any) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"{demo.service}/eligibility?image={demo.ref('cuda-ubuntu:12.2')}&gpus=1")
        rows = page.locator("table.eligible tbody tr")
        assert rows.count() >= 2
        whys = [row.locator("td.why").inner_text() for row in rows.all()]
        assert all(whys) and any("brand exception" in why for why in whys), whys
        assert "Needs an NVIDIA GPU with driver ≥ 535.54.03" in page.locator(".image-answer").inner_text()
    finally:
        page.close()


# --- errors a newcomer can act on ---------------------------------------------------------------------


def test_serve_on_a_taken_port_says_so_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        done = cli("serve", "--port", str(port), "--db", str(tmp_path / "x.db"), timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"port {port}" in done.stderr and "--port" in done.stderr and "GPUBADGE_PORT" in done.stderr
    assert time.monotonic() - started < 20  # before anything starts


def test_version_and_a_platform_the_image_lacks(demo: Demo, tmp_path: Path) -> None:
    version = cli("--version")
    assert version.returncode == 0 and re.fullmatch(r"gpubadge \d+\.\d+\.\d+\S*\n", version.stdout)
    db = str(tmp_path / "cli.db")
    for name in ("static:1", "multi-arch:12.4"):  # a single-platform image and an index
        for _ in range(2):  # fresh, then from the store
            done = cli("scan", demo.ref(name), "--platform", "linux/s390x", "--db", db)
            assert done.returncode == 1, (name, done.stdout, done.stderr)
            assert "no platform linux/s390x in this image (it has linux/amd64" in done.stderr
            assert "unknown/unknown" not in done.stderr  # an attestation is not a platform


def test_gpubadge_is_the_service_where_service_is_taken(demo: Demo) -> None:
    image = demo.ref("cuda-ubuntu:12.2")
    asked = cli("eligible", image, "--gpus", "1", env={"GPUBADGE": demo.service})
    assert asked.returncode == 0, asked.stderr
    assert "eligible" in asked.stdout and "needs an NVIDIA GPU" in asked.stdout
    explained = cli("eligible", image, "--explain", "all", env={"GPUBADGE": demo.service})
    assert "because " in explained.stdout  # why each server passes
    compat = cli("compat", image, env={"GPUBADGE": demo.service})
    assert compat.returncode in (0, 3) and "compatible" in compat.stdout, compat.stderr
    missing = cli("eligible", image)
    assert missing.returncode == 2 and "GPUBADGE" in missing.stderr and "--service" in missing.stderr
    wrong = cli("eligible", image, env={"GPUBADGE": "127.0.0.1:8080"})
    assert wrong.returncode == 2 and "GPUBADGE" in wrong.stderr and "http://127.0.0.1:8080" in wrong.stderr


def test_the_explorer_answers_bad_input_in_plain_words(demo: Demo) -> None:
    image = urllib.parse.quote(demo.ref("cuda-ubuntu:12.2"))
    reply = call("GET", f"{demo.service}/eligibility?image={image}&gpus=two")
    assert reply.status == 400
    assert "GPU count: expected an integer, got &#39;two&#39;" in reply.text
    assert "Input should" not in reply.text and "unable to parse" not in reply.text
    api = call(
        "POST", f"{demo.service}/api/eligibility", {"image": demo.ref("cuda-ubuntu:12.2"), "gpus": "two"}
    )
    assert api.status == 400 and api.body["error"] == "invalid request: gpus: expected an integer, got 'two'"


def attestation_of(demo: Demo, name: str) -> str:
    """The digest of the buildx attestation manifest in a demo index (read from the registry)."""
    repository, _, tag = name.partition(":")
    reply = call(
        "GET",
        f"http://{demo.registry}/v2/samples/{repository}/manifests/{tag}",
        headers={"Accept": "application/vnd.oci.image.index.v1+json"},
    )
    index = json.loads(reply.text)
    (found,) = [
        m["digest"]
        for m in index["manifests"]
        if m.get("annotations", {}).get("vnd.docker.reference.type") == "attestation-manifest"
    ]
    return str(found)


def test_a_scan_of_an_attestation_says_what_it_is_and_offers_no_scan_again(demo: Demo) -> None:
    reference = f"{demo.registry}/samples/multi-arch@{attestation_of(demo, 'multi-arch:12.4')}"
    job = call("POST", f"{demo.service}/api/scans", {"ref": reference})  # "Scan it now"
    assert job.status in (200, 202), job.text
    deadline = time.monotonic() + 60
    while job.body["state"] in ("queued", "running") and time.monotonic() < deadline:
        job = call("GET", f"{demo.service}/api/scans/{job.body['id']}?wait=10", timeout=20)
    assert job.body["state"] == "done", job.body
    page = call("GET", f"{demo.service}/images/{reference}")
    assert page.status == 404 and "Not a container image" in page.text
    assert 'action="/scans"' not in page.text  # no button that scans it again, and again
    assert "not an image" in demo.get("/scans")


# --- pages --------------------------------------------------------------------------------------------


def child_of(demo: Demo, name: str, architecture: str) -> str:
    reply = by_ref(demo.service, demo.ref(name))
    (digest,) = [
        p["digest"] for p in reply.body["platforms"] if p["platform"].startswith(f"linux/{architecture}")
    ]
    return str(digest)


def test_a_platform_reached_by_digest_shows_its_scan_time_not_now(demo: Demo) -> None:
    index = by_ref(demo.service, demo.ref("multi-arch:12.4")).body
    child = f"{demo.registry}/samples/multi-arch@{child_of(demo, 'multi-arch:12.4', 'arm64')}"
    first = by_ref(demo.service, child).body
    time.sleep(1.1)  # a second later: "now" would have moved
    again = by_ref(demo.service, child).body
    assert first["scanned_at"] == again["scanned_at"] == index["scanned_at"]
    page = demo.get(f"/images/{child}")
    shown = re.search(r'<dd class="scanned"><time datetime="([^"]+)"', page)
    assert shown and datetime.fromisoformat(shown.group(1)) == datetime.fromisoformat(index["scanned_at"])
    assert "platform of the index" in page and "multi-arch:12.4" in page


def test_the_scans_page_shows_verdicts_and_marks_index_children(demo: Demo) -> None:
    page = demo.get("/scans")
    assert page.count('class="index-child"') >= 2  # the multi-arch index's two platform manifests
    assert re.search(r'class="index-child".*?the <code>linux/(amd64|arm64)', page, re.S)
    verdicts = re.findall(r'<td class="verdict">(.*?)</td>', page, re.S)
    assert any("NVIDIA GPU" in v for v in verdicts) and any("CPU only" in v for v in verdicts)


def test_servers_page_says_true_things_and_sizes_as_the_explorer_does(demo: Demo) -> None:
    page = demo.get("/servers")
    assert "static" not in re.sub(r"<[^>]+>", " ", page).split("Last heartbeat", 1)[1]
    assert "none: from the inventory file" in page
    answer = eligibility(demo, demo.ref("cuda-ubuntu:12.2"), gpus=1, min_gpu_memory="40Gi")
    reasons = [item["reason"] for item in answer["ineligible_by_reason"]]
    sizes = {m for reason in reasons for m in re.findall(r"GPU memory ([\d.]+ GiB) <", reason)}
    assert sizes, reasons
    for size in sizes:  # every size the explorer names is written the same way on /servers
        assert f"· {size} ·" in page, (size, re.findall(r"· ([\d.]+ GiB) ·", page))


def test_a_second_name_of_a_digest_is_found_by_search(demo: Demo) -> None:
    done = subprocess.run(
        ["skopeo", "copy", "--all", "--preserve-digests", "--src-tls-verify=false", "--dest-tls-verify=false",
         f"docker://{demo.ref('static:1')}", f"docker://{demo.registry}/prod/static:1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert by_ref(demo.service, f"{demo.registry}/prod/static:1", wait=60).status == 200
    deadline = time.monotonic() + 30
    while "prod/static" not in (listing := demo.get("/?q=prod/static")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "samples/static" in listing and f"{demo.registry}/prod/static:1" in listing
    api = json.loads(demo.get("/api/images?q=prod%2Fstatic"))["images"]
    assert [image["other_names"] for image in api] == [[f"{demo.registry}/prod/static:1"]]
    # a search text is bounded, as every report is matched against it: past it a 400 names the option
    assert json.loads(demo.get("/api/images?q=" + "s" * 200))["images"] == []
    refused = call("GET", f"{demo.service}/api/images?q={'s' * 201}")
    assert refused.status == 400 and json.loads(refused.text)["error"] == "q: at most 200 characters"


# The text before each line break inside the elements a selector names (a break: the next character's top lower).
LINE_BREAKS = """selector => [...document.querySelectorAll(selector)].flatMap(element => {
    const text = element.textContent, range = document.createRange(), found = [];
    const walker = document.createTreeWalker(element, NodeFilter.SHOW_TEXT);
    let offset = 0, lastTop = null;
    while (walker.nextNode()) {
        const node = walker.currentNode;
        for (let i = 0; i < node.length; i++) {
            range.setStart(node, i); range.setEnd(node, i + 1);
            const top = range.getBoundingClientRect().top;
            if (lastTop !== null && top > lastTop + 2) found.push(text.slice(0, offset + i));
            lastTop = top;
        }
        offset += node.length;
    }
    return found;
})"""
PAGES = ("/", "/scans", "/servers", "/eligibility?image={tour}&gpus=1&min_gpu_memory=40Gi")


@pytest.mark.parametrize("width", [1280, 400])
def test_pages_fit_names_wrap_at_separators_and_read_well(demo: Demo, browser: Any, width: int) -> None:
    context = browser.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    try:
        images = [f"/images/{demo.ref(name)}" for name in (
            "cuda-ubuntu:12.2", "pip-torch:2.3", "cuda-newer-inside:11.8", "bad-require:12.2", "multi-arch:12.4"
        )]  # fmt: skip
        for path in [*(p.format(tour=demo.ref("cuda-ubuntu:12.2")) for p in PAGES), *images]:
            page.goto(demo.service + path)
            scroll, view = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
            assert scroll <= view, f"{path} scrolls sideways at {width} px ({scroll} > {view})"
        # image names break only after a separator, never inside a word: in the list and as a page's title
        for path, selector in (
            ("/", ".image-name"),
            (f"/images/{demo.ref('cuda-newer-inside:11.8')}", "h1.ref"),
        ):
            page.goto(demo.service + path)
            breaks = page.evaluate(LINE_BREAKS, selector)
            assert all(before[-1] in "/:@-" for before in breaks), (path, breaks)
        # the detail page: captions on one or two lines, one parse error said once
        page.goto(demo.service + f"/images/{demo.ref('bad-require:12.2')}")
        heights = page.evaluate(
            "[...document.querySelectorAll('.kv caption')].map(c => c.getBoundingClientRect().height /"
            " parseFloat(getComputedStyle(c).lineHeight || 20))"
        )
        assert heights and max(heights) < 2.6, heights
        body = page.locator("main").inner_text()
        assert body.count("arch version 'sm_80' may contain only digits and dots") == 1, body
    finally:
        context.close()
