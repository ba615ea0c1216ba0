"""Loading a config: a TOML file, then command-line flags, then ``--set section.key=value``."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from pydantic import ValidationError, model_validator

from libra.config import ConfigError, RenamedWarning, Section, load_config
from libra.launch import RolloutConfig, TrainRunConfig


def test_config_precedence(tmp_path: Path) -> None:
    file = tmp_path / "run.toml"
    file.write_text('env = "guess"\nn = 8\n[engine]\nmax_turns = 3\nconcurrency = 2\n')
    config = load_config(
        RolloutConfig,
        file,
        {"n": 16, "seed": None},
        ["engine.concurrency=5", "engine.sampling.temperature=0.5", "model=plain text"],
    )
    assert (config.env, config.n, config.seed) == ("guess", 16, 0)
    assert config.engine.max_turns == 3 and config.engine.concurrency == 5
    assert config.engine.sampling.temperature == 0.5 and config.model == "plain text"
    with pytest.raises(ConfigError, match=r"expects section\.key=value"):
        load_config(RolloutConfig, None, {"env": "calc"}, ["novalue"])
    file.write_text("env = ")
    with pytest.raises(ConfigError, match=r"run\.toml"):
        load_config(RolloutConfig, file)


class Inner(Section):
    size: int = 1
    names: tuple[str, ...] = ()


class Outer(Section):
    label: str = "default"
    inner: Inner = Inner()

    @model_validator(mode="after")
    def _labelled(self) -> Outer:
        if self.label == "":
            raise ValueError("label must not be empty")
        return self


def test_given_defaults_sit_below_the_file(tmp_path: Path) -> None:
    file = tmp_path / "run.toml"
    file.write_text('label = "from file"\n')
    config = load_config(Outer, file, defaults={"label": "given", "inner.size": 4})
    assert (config.label, config.inner.size) == ("from file", 4)


def test_set_values_are_read_as_toml_or_else_as_text() -> None:
    overrides = ["inner.names=['a', 'b']", "inner.size = 3", "label=two words"]
    config = load_config(Outer, overrides=overrides)
    assert (config.inner.names, config.inner.size, config.label) == (("a", "b"), 3, "two words")
    assert load_config(Outer, overrides=['label="7"']).label == "7"


def test_errors_are_one_line_and_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"cannot set label\.size: label is not a section"):
        load_config(Outer, flags={"label": "x"}, overrides=["label.size=2"])
    with pytest.raises(ConfigError, match=r"^invalid config: inner\.size: .*integer") as error:
        load_config(Outer, overrides=["inner.size=many"])
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Outer, Path("missing.toml"))
    # A validator's own words, with no empty location nor pydantic's "Value error, ".
    with pytest.raises(ConfigError) as error:
        load_config(Outer, overrides=['label=""'])
    assert str(error.value) == "invalid config: label must not be empty"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("inner.colour=red", "unknown key inner.colour (valid keys of [inner]: size, names)"),
        (
            "inner.sizes=2",
            "unknown key inner.sizes; did you mean inner.size? (valid keys of [inner]",
        ),
        ("lable=x", "unknown key lable; did you mean label? (valid keys of the top level: label,"),
    ],
)
def test_an_unknown_key_lists_its_section_s_keys_and_the_closest(
    override: str, message: str
) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(Outer, overrides=[override])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_unknown_keys_are_found_through_optional_sections_and_lists(tmp_path: Path) -> None:
    file = tmp_path / "run.toml"
    file.write_text('env = "calc"\n[[fleet.instances]]\nname = "a"\nurll = "http://x"\n')
    with pytest.raises(ConfigError, match=r"did you mean fleet\.instances\.0\.url\? \(valid keys"):
        load_config(RolloutConfig, file)


def test_a_section_is_immutable() -> None:
    config = load_config(Outer)
    with pytest.raises(ValidationError, match="frozen"):
        config.label = "changed"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("package", "old", "new"),
    [
        ("libra.train", "Gateway", "GatewayClient"),
        ("libra.alloc", "Decision", "AllocationDecision"),
        ("libra.alloc", "Workload", "Demand"),
        ("libra.sched.policies", "Decision", "RouteDecision"),
        ("libra.trainer", "Layout", "BatchLayout"),
    ],
)
def test_a_renamed_name_still_imports_for_a_release_with_a_warning(
    package: str, old: str, new: str
) -> None:
    module = importlib.import_module(package)
    with pytest.warns(RenamedWarning, match=f"^{package}.{old} is now {package}.{new}"):
        assert getattr(module, old) is getattr(module, new)
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        module.Nothing  # noqa: B018 (the lookup is the test)


def test_a_section_given_merges_over_what_its_default_sets(tmp_path: Path) -> None:
    """``TrainRunConfig.vllm`` defaults to priority scheduling and 8192 tokens; a file's
    ``[vllm]`` or a ``--set vllm.*`` changes only the keys it names."""
    file = tmp_path / "run.toml"
    file.write_text('[rollout]\nenv = "calc"\n[vllm]\nstartup_timeout_s = 400\n')
    config = load_config(TrainRunConfig, file, overrides=["vllm.kv_cache_gib=3"])
    vllm = config.vllm
    assert (vllm.scheduling_policy, vllm.max_model_len) == ("priority", 8192)
    assert (vllm.startup_timeout_s, vllm.kv_cache_gib) == (400, 3)
    fcfs = load_config(TrainRunConfig, file, overrides=["vllm.scheduling_policy=fcfs"])
    assert fcfs.vllm.scheduling_policy == "fcfs"  # a key it names still changes
