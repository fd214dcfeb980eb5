"""The workspace codec: JSON tree + tensors, and back, for every supported value."""

from __future__ import annotations

import json
import math
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from jobrun.errors import CheckpointError
from jobrun.store import tensorfile
from jobrun.store.codec import TAG, SavedState, UnsupportedValue, decode, encode, restore


def through_a_file(tensors: dict[str, Any], as_numpy: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tensors.safetensors"
        tensorfile.write(path, tensors, 1 << 20)
        return tensorfile.read(path, as_numpy=as_numpy)


def round_trip(blobs: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """encode -> strict JSON text + a safetensors file -> decode, as a checkpoint does."""
    tree, tensors = encode(blobs, **kw)
    text = json.dumps(tree, allow_nan=False)
    return decode(json.loads(text), through_a_file(tensors))


def same(a: Any, b: Any) -> bool:
    """Deep equality that also checks types (tuple vs list, int vs float, dtypes)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(
            type(k) is type(j) and same(a[k], b[j]) for k, j in zip(a, b)
        )
    return a == b


SCALARS = [None, True, False, 0, -7, 2**70, 1.5, -0.0, 1e-300, math.inf, -math.inf, "", "ünï €"]


@pytest.mark.parametrize("value", SCALARS, ids=repr)
def test_scalars(value: Any) -> None:
    assert same(round_trip({"v": value})["v"], value)


def test_nan() -> None:
    assert math.isnan(round_trip({"v": float("nan")})["v"])


def test_nested_containers_keep_their_types() -> None:
    value = {
        "list": [1, [2.5, "x"], (3, (4, None)), []],
        "tuple": (1, [2], {"a": ()}),
        "int keys": {0: {"step": 3}, 1: {"step": 4}},
        "mixed keys": {
            1: "int",
            "1": "str",
            1.5: "float",
            None: "none",
            (1, "a"): "tuple",
            False: "b",
        },
        "empty": {},
        "bytes": b"\x00\xffabc",
        "np": [np.float32(1.5), np.int64(-3), np.bool_(True), np.uint8(200), np.float64(np.nan)],
    }
    back = round_trip({"v": value})["v"]
    assert same(back["list"], value["list"])
    assert same(back["tuple"], value["tuple"])
    assert same(back["int keys"], value["int keys"])
    assert same(back["mixed keys"], value["mixed keys"])
    assert back["bytes"] == value["bytes"]
    np_back = back["np"]
    assert [type(x) for x in np_back] == [type(x) for x in value["np"]]
    assert np_back[:4] == value["np"][:4] and np.isnan(np_back[4])


def test_user_dicts_cannot_pose_as_tags() -> None:
    sneaky = {TAG: "tensor", "key": "v"}
    nested = {"a": [{TAG: "tuple", "items": [1]}]}
    back = round_trip({"s": sneaky, "n": nested})
    assert back == {"s": sneaky, "n": nested}


def test_tensors_of_many_kinds() -> None:
    values = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "f16": torch.randn(2, 2).half(),
        "i64": torch.arange(6).reshape(2, 3),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "strided": torch.arange(20.0).reshape(4, 5)[:, ::2],
        "c64": torch.randn(3, dtype=torch.complex64),
        "c128": torch.randn(2, 2, dtype=torch.complex128),
        "conj": torch.randn(3, dtype=torch.complex128).conj(),
        "u8": torch.arange(5, dtype=torch.uint8),
    }
    back = round_trip({"t": values, "top": values["f32"]})
    for name, t in values.items():
        got = back["t"][name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got, t.resolve_conj()), name
    assert torch.equal(back["top"], values["f32"])


def test_parameters_and_requires_grad_survive() -> None:
    p = torch.nn.Parameter(torch.randn(3))
    leaf = torch.randn(2, requires_grad=True)
    back = round_trip({"p": p, "leaf": leaf, "plain": torch.ones(1)})
    assert isinstance(back["p"], torch.nn.Parameter) and back["p"].requires_grad
    assert torch.equal(back["p"].detach(), p.detach())
    assert back["leaf"].requires_grad and not back["plain"].requires_grad


def test_numpy_arrays_come_back_as_numpy() -> None:
    arrays = {
        "f": np.linspace(0, 1, 5),
        "i": np.arange(6, dtype=np.int32).reshape(2, 3).T,  # non-contiguous
        "b": np.array([True, False]),
        "c": np.array([1 + 2j, 3 - 4j]),
        "scalar": np.array(7, dtype=np.int16),
    }
    back = round_trip({"a": arrays})["a"]
    for name, a in arrays.items():
        assert isinstance(back[name], np.ndarray), name
        assert back[name].dtype == a.dtype and np.array_equal(back[name], a), name


def test_tensor_keys_are_readable_and_unique() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    odd = {"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}, "x": [torch.full((1,), 2.0)]}
    tree, tensors = encode(
        {"model": model, "odd": odd, "t": torch.ones(2), "__metadata__": torch.ones(1)}
    )
    assert {"model.0.weight", "model.0.bias", "model.2.weight", "t", "odd.x.0"} <= set(tensors)
    assert "__metadata__" not in tensors  # reserved by safetensors
    odd_keys = [k for k in tensors if k.startswith("odd.a")]
    assert len(odd_keys) == 2 and "odd.a.b" in odd_keys
    back = round_trip({"odd": odd, "__metadata__": torch.ones(1)})
    assert torch.equal(back["odd"]["a.b"], torch.zeros(1))
    assert torch.equal(back["odd"]["a"]["b"], torch.ones(1))


def test_copy_makes_private_tensors() -> None:
    t = torch.zeros(4)
    a = np.zeros(3)
    _, shared = encode({"t": t, "a": a})
    _, private = encode({"t": t, "a": a}, copy=True)
    t.add_(1)
    a += 1
    assert torch.equal(shared["t"], torch.ones(4))  # same memory
    assert torch.equal(private["t"], torch.zeros(4))
    assert np.array_equal(private["a"], np.zeros(3))


def test_copies_go_into_an_earlier_copy_and_stay_private() -> None:
    g = torch.Generator().manual_seed(1)
    ws = {
        "big": torch.randn(10_007, generator=g),
        "half": torch.randn(3001, generator=g).half(),
        "strided": torch.randn(200, 50, generator=g).t(),  # not contiguous
        "arr": np.arange(5000, dtype=np.int64),
        "arr_t": np.arange(6000, dtype=np.float32).reshape(60, 100).T,
        "empty": torch.empty(0),
    }
    _, fresh = encode(ws, copy=True)
    _, again = encode(ws, copy=True, reuse=fresh)  # into the same memory
    for key in ws:
        want = ws[key].contiguous() if isinstance(ws[key], torch.Tensor) else ws[key]
        for got in (fresh[key], again[key]):
            assert type(got) is type(want) and got.shape == want.shape and got.dtype == want.dtype
            assert (torch.equal(got, want) if isinstance(got, torch.Tensor)
                    else np.array_equal(got, want))
    assert again["big"].data_ptr() == fresh["big"].data_ptr()
    assert again["arr"].ctypes.data == fresh["arr"].ctypes.data
    assert again["strided"].is_contiguous() and again["arr_t"].flags.c_contiguous
    ws["big"].add_(1)
    ws["arr"] += 1
    assert not torch.equal(again["big"], ws["big"])  # still private copies
    assert not np.array_equal(again["arr"], ws["arr"])


def test_module_state_restores_into_a_fresh_module() -> None:
    torch.manual_seed(0)
    src = torch.nn.Linear(4, 3)
    bn = torch.nn.BatchNorm1d(3)
    bn(torch.randn(8, 3))  # non-trivial running stats
    back = round_trip({"lin": src, "bn": bn})
    assert isinstance(back["lin"], SavedState)
    assert back["lin"].type_name == "torch.nn.modules.linear.Linear"
    dst = torch.nn.Linear(4, 3)
    restore(dst, back["lin"])
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)
    bn2 = torch.nn.BatchNorm1d(3)
    restore(bn2, back["bn"])
    for k, v in bn.state_dict().items():
        assert torch.equal(bn2.state_dict()[k], v), k
    assert back["bn"].state._metadata == bn.state_dict()._metadata


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(8, 4, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.9)),
    ],
    ids=["sgd-momentum", "adam"],
)
def test_optimizer_state_resumes_exactly(make) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = make(model.parameters())
    _train(model, opt, 2)
    back = round_trip({"model": model, "opt": opt})
    saved = back["opt"].state
    assert set(saved["state"]) == {0, 1}  # int keys kept
    assert isinstance(saved["param_groups"][0]["params"], list)

    model2 = torch.nn.Linear(4, 2)
    opt2 = make(model2.parameters())
    restore(model2, back["model"])
    restore(opt2, back["opt"])
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(opt2.state_dict()["state"][0][k], v), k
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    _train(model, opt, 1)
    _train(model2, opt2, 1)
    assert torch.equal(model.weight, model2.weight)


def test_scheduler_and_grad_scaler() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    back = round_trip({"sched": sched, "scaler": scaler})
    sched2 = torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD(model.parameters(), lr=1.0), step_size=2, gamma=0.5
    )
    restore(sched2, back["sched"])
    assert sched2.state_dict() == sched.state_dict()
    scaler2 = torch.amp.GradScaler("cpu")
    restore(scaler2, back["scaler"])
    assert scaler2.state_dict() == scaler.state_dict()


def test_generator_state() -> None:
    g = torch.Generator().manual_seed(42)
    torch.rand(5, generator=g)
    back = round_trip({"rng": g})["rng"]
    assert isinstance(back, SavedState) and back.type_name == "torch.Generator"
    fresh = torch.Generator()
    restore(fresh, back)
    assert torch.equal(torch.rand(10, generator=fresh), torch.rand(10, generator=g))


class Counter:
    """Stands for our Reader: plain state through state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def test_custom_object_with_state_dict() -> None:
    c = Counter()
    c.n = 5
    back = round_trip({"c": c})["c"]
    assert back == SavedState(f"{__name__}.Counter", {"n": 5})
    fresh = Counter()
    restore(fresh, back)
    assert fresh.n == 5
    with pytest.raises(CheckpointError, match="no load_state_dict"):
        restore(object(), back)


@pytest.mark.parametrize(
    "value, type_name",
    [
        (object(), "object"),
        ({1, 2}, "set"),
        (lambda: 0, "function"),
        ([1, {"deep": [complex(1, 2)]}], "complex"),
        ({frozenset(): 1}, "dict key"),
        (Counter, "type"),
        (torch.randn(2, 2).to_sparse(), "sparse"),
    ],
    ids=["object", "set", "lambda", "nested complex", "frozenset key", "a class", "sparse"],
)
def test_unsupported_values_name_the_blob(value: Any, type_name: str) -> None:
    with pytest.raises(UnsupportedValue) as info:
        encode({"ok": 1, "bad": value})
    assert info.value.blob == "bad"
    assert type_name in info.value.message


def test_cycles_are_unsupported_not_a_crash() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(UnsupportedValue, match="self-containing list"):
        encode({"loop": loop})


def test_on_unsupported_skips_the_blob_and_keeps_the_rest() -> None:
    seen: list[UnsupportedValue] = []
    tree, tensors = encode(
        {"a": torch.ones(2), "bad": {"t": torch.zeros(3), "x": object()}, "b": 2},
        on_unsupported=seen.append,
    )
    assert [e.blob for e in seen] == ["bad"]
    assert set(tree) == {"a", "b"} and set(tensors) == {"a"}  # no half-encoded blob


def test_blob_names_are_checked() -> None:
    with pytest.raises(ValueError):
        encode({"a.b": 1})


def test_decode_rejects_malformed_trees() -> None:
    with pytest.raises(CheckpointError, match="unknown tag"):
        decode({"x": {TAG: "pickle"}}, {})
    with pytest.raises(CheckpointError, match="missing from tensors"):
        decode({"x": {TAG: "tensor", "key": "nope"}}, {})
    with pytest.raises(CheckpointError, match="malformed"):
        decode({"x": {TAG: "tuple"}}, {})
    with pytest.raises(CheckpointError, match="malformed"):
        decode({"x": {TAG: "dict", "items": [[[1, 2], 3]]}}, {})  # a list key
    with pytest.raises(CheckpointError, match="malformed"):
        decode({"x": {TAG: "np_scalar", "dtype": "O", "v": 1}}, {})
    with pytest.raises(CheckpointError, match="malformed"):
        decode([1], {})  # type: ignore[arg-type]


def test_decode_with_numpy_tensors_never_needs_torch() -> None:
    model = torch.nn.Linear(2, 2)
    blobs = {"m": model, "c": torch.randn(2, dtype=torch.complex128), "h": torch.ones(2).half()}
    tree, tensors = encode(blobs)
    back = decode(tree, through_a_file(tensors, as_numpy=True))
    assert isinstance(back["m"].state["weight"], np.ndarray)
    assert np.array_equal(back["m"].state["weight"], model.weight.detach().numpy())
    assert back["c"].dtype == np.complex128 and np.array_equal(back["c"], blobs["c"].numpy())
    assert back["h"].dtype == np.float16


def test_ordered_dict_without_metadata_is_a_dict() -> None:
    od = OrderedDict([("b", 1), ("a", 2)])
    back = round_trip({"od": od})["od"]
    assert back == od and list(back) == ["b", "a"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_values_come_back_on_the_cpu() -> None:
    t = torch.randn(3, 4, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    tree, tensors = encode({"t": t, "g": g}, copy=True)
    assert tensors["t"].device.type == "cpu" and tree["t"]["device"].startswith("cuda")
    back = round_trip({"t": t, "g": g})
    assert back["t"].device.type == "cpu" and torch.equal(back["t"], t.cpu())
    fresh = torch.Generator(device="cuda")
    restore(fresh, back["g"])
    assert torch.equal(
        torch.rand(4, device="cuda", generator=fresh), torch.rand(4, device="cuda", generator=g)
    )
