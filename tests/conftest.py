"""Shared fixtures. Async tests run on every anyio backend unless a module narrows it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import pytest

from libra.envs import SandboxError
from libra.sandbox import build_image, build_rootfs, connect_docker
from libra.serving import VLLMServer, prepare_model
from tests._helpers import (
    REAL_MODEL_NAME,
    TINY,
    real_config,
    require_vllm,
    tiny_llama,
    unavailable,
)

if TYPE_CHECKING:
    import docker
    from selenium.webdriver.remote.webdriver import WebDriver


#: ``--profile FILE``: each test's seconds, started processes and peak memory.
pytest_plugins = ["tests._profile"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long-faults",
        action="store_true",
        help="also run the long fault-injection tests (faults_long; `make test-faults`)",
    )


#: The marker each real component's fixture puts on the tests that ask for it, so that
#: ``make check`` (``-m "not (slow or vllm or docker or bwrap or trainer or ray or browser)"``)
#: leaves out every test that needs a real server, engine or process group.
MARKER_OF_FIXTURE = {
    "embedded_model": "vllm",
    "real_server": "vllm",
    "docker_client": "docker",
    "bwrap_root": "bwrap",
    "tiny_model": "trainer",
    "ray_instance": "ray",
    "browser": "browser",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            if fixture in MARKER_OF_FIXTURE:
                item.add_marker(MARKER_OF_FIXTURE[fixture])
    if config.getoption("--long-faults"):
        return
    skip = pytest.mark.skip(reason="a long fault test: run with --long-faults (make test-faults)")
    for item in items:
        if "faults_long" in item.keywords:
            item.add_marker(skip)


#: Where async tests run on trio as well as asyncio: the packages (under tests/) whose code
#: has paths of its own on trio (bare asyncio tasks and loops kept apart, trio's clock and
#: cancellation), and the clock. Elsewhere libra's async code is anyio's alone, and a
#: second run of a test on trio tests anyio rather than libra.
ON_TRIO_TOO = {"bench", "emulation", "engine", "gateway", "sched", "test_clock.py"}


@pytest.fixture
def anyio_backend() -> str:
    """asyncio; on trio too where :data:`ON_TRIO_TOO` says (``pytest_generate_tests``)."""
    return "asyncio"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    definitions = metafunc._arg2fixturedefs.get("anyio_backend", ())
    if not definitions or definitions[-1].func.__module__ != __name__:
        return  # not async, or a module picks its own backends
    if any(
        "anyio_backend" in str(m.args[0]) for m in metafunc.definition.iter_markers("parametrize")
    ):
        return  # the test picks its own
    where = Path(metafunc.definition.path).relative_to(Path(__file__).parent).parts[0]
    if where in ON_TRIO_TOO:
        metafunc.parametrize("anyio_backend", ["asyncio", "trio"])


# ------------------------------------------------ real vLLM on the embedded model (slow)


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    require_vllm()
    return prepare_model()


@pytest.fixture(scope="session")
def real_server(
    embedded_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMServer]:
    """One real vLLM server for the whole session: starting one costs ~20-30 s here."""
    log_file = tmp_path_factory.mktemp("vllm-logs") / "server.log"
    config = real_config(dev_mode=True, scheduling_policy="priority", log_file=log_file)
    with VLLMServer(embedded_model, served_model_name=REAL_MODEL_NAME, config=config) as server:
        yield server


# ----------------------------------------------------- a real Docker engine and image


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    """The Docker engine (started by `make test` as root) with the sandbox image built."""
    try:
        client = connect_docker()
    except SandboxError as error:
        unavailable(f"no Docker engine reachable (run scripts/ensure-docker.sh as root): {error}")
    build_image("libra/python", client=client)  # idempotent: instant when already built
    yield client
    client.close()


# ----------------------------------------------- a real browser: Debian's Chromium, headless

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


@pytest.fixture(scope="session")
def browser() -> Iterator[WebDriver]:
    """Headless Chromium from the system's packages (`make test` installs them as root),
    driven by Selenium through the system's ChromeDriver: nothing downloads a browser."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        unavailable("no Chromium and ChromeDriver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    # As the machines' probe ran it: no sandbox as root, and no background networking,
    # whose connections this machine's closed network refuses.
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,1800",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    yield driver
    driver.quit()


# ------------------------------------------------------- bubblewrap and its root filesystem


@pytest.fixture(scope="session")
def bwrap_root() -> Path | Literal["host"]:
    """The image's root filesystem when it can be built here (root and debootstrap), else
    "host": the host's system dirs."""
    if shutil.which("bwrap") is None:
        unavailable("bubblewrap is not installed (apt-get install bubblewrap)")
    if os.geteuid() == 0 and shutil.which("debootstrap"):
        return build_rootfs("libra/python")  # idempotent: instant when already built
    return "host"


# ------------------------------------------------------------------- a small workload file


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama's folder (its vocabulary covers the emulator's byte tokens):
    what the trainer's tests train, in its processes, in seconds."""
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path
