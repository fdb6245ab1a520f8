"""`onnxgen.config`: typed load options, validated by name, per-device defaults in one place; and
`onnxgen.envs`, the registry of environment variables."""

from __future__ import annotations

import dataclasses

import pytest

import onnxgen
import onnxgen.envs as envs
from onnxgen.config import CacheConfig, Config, DecodingConfig, ModelConfig, SchedulerConfig
from onnxgen.errors import InvalidRequest


def test_flat_options_name_exactly_one_field_each():
    where = Config.options()
    names = [
        f.name
        for cls in (ModelConfig, CacheConfig, SchedulerConfig, DecodingConfig)
        for f in dataclasses.fields(cls)
    ]
    assert len(names) == len(set(names)) == len(where)
    cfg = Config().replace(device="cuda", max_running=32, decode_steps=4, paged=True)
    assert (cfg.model.device, cfg.scheduler.max_running, cfg.decoding.decode_steps, cfg.cache.paged) == (
        "cuda",
        32,
        4,
        True,
    )
    assert Config() == Config() and cfg.replace() == cfg  # frozen values


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("backend", "onnx"),
        ("device", "tpu"),
        ("int4", "int8"),
        ("threads", 0),
        ("max_running", "2"),
        ("max_batch_tokens", 1.5),
        ("chunk_size", 0),
        ("kv_bytes", -1),
        ("decode_steps", 0),
        ("launch_first", 1),
        ("speculative", "medusa"),
        ("max_new_tokens", 0),
        ("max_sessions", -1),
    ],
)
def test_a_bad_value_is_an_error_naming_its_option(name, bad):
    with pytest.raises(InvalidRequest, match=name) as e:
        Config().replace(**{name: bad})
    assert e.value.field == name


def test_an_unknown_option_lists_the_known_ones():
    with pytest.raises(InvalidRequest, match="chunksize") as e:
        Config().replace(chunksize=64)
    assert "chunk_size" in str(e.value) and "decode_steps" in str(e.value)


def test_defaults_by_device_and_kv_kind_live_in_the_config():
    sch, dec = SchedulerConfig(), DecodingConfig()
    assert (sch.running_for(True, True), sch.running_for(False, True), sch.running_for(False, False)) == (
        64,
        16,
        8,
    )
    assert (sch.budget_for(True, True), sch.budget_for(False, True)) == (4096, 512)
    assert (dec.steps_for(True, True), dec.steps_for(True, False), dec.steps_for(False, True)) == (8, 1, 1)
    assert dec.launch_first_for(True) and not dec.launch_first_for(False)
    assert SchedulerConfig(max_running=3).running_for(True, True) == 3
    assert DecodingConfig(speculative=False).speculative == "off"
    assert (
        ModelConfig(device="cuda").resolved_backend() == "native"
        and ModelConfig().resolved_backend() == "ort"
    )


def test_backend_options_pass_on_only_what_was_set():
    assert Config().backend_options() == {}
    cfg = Config().replace(threads=2, kv_floor=64, int4="packed", cuda_graphs=False)
    assert cfg.backend_options() == {"threads": 2, "kv_floor": 64, "int4": "packed", "cuda_graphs": False}


def test_load_takes_a_config_and_overrides_on_top(tiny_dir):
    cfg = Config(model=ModelConfig(backend="ort", threads=1), scheduler=SchedulerConfig(max_running=3))
    m = onnxgen.load(str(tiny_dir), cfg, max_sessions=2)
    assert m.config.scheduler.max_running == 3 == m.max_running and m.config.cache.max_sessions == 2
    assert m.backend == "ort"


def test_environment_variables_are_read_when_asked(monkeypatch):
    assert envs.GEMV_ROWS == 4
    monkeypatch.setenv("ONNXGEN_GEMV_ROWS", "2")
    assert envs.GEMV_ROWS == 2
    monkeypatch.setenv("ONNXGEN_NORM_LATE", "off")
    assert envs.read("NORM_LATE") is False
    monkeypatch.setenv("ONNXGEN_PDL", "maybe")
    with pytest.raises(ValueError, match="ONNXGEN_PDL"):
        envs.read("PDL")
    monkeypatch.setenv("ONNXGEN_HOME", "/tmp/somewhere")
    assert str(envs.HOME) == "/tmp/somewhere"
    with pytest.raises(AttributeError):
        envs.NOT_A_VARIABLE  # noqa: B018
    assert [n for n, _, _ in envs.describe()] == [v.name for v in envs.VARS.values()]


def test_the_config_passes_on_exactly_the_options_the_backends_declare():
    """Every option a backend declares has a config field, and the config passes on nothing else."""
    from onnxgen.backends import backend_options

    declared = {o for opts in backend_options().values() for o in opts}
    every = {name: 1 for name in declared}
    every.update(int4="packed", kv_mode="shared", cuda_graphs=True, static_steps=True, spinning=True)
    every.update(last_logits=True, first_multi=True, tensor_parallel=2)  # 1 is off: not passed on
    assert set(Config().replace(**every).backend_options()) == declared
