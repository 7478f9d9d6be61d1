"""``checks.check_tensor``, ``check_token_ids`` and ``check_device`` at their edges: the survivors of the
forty-fourth session's mutation run of them (docs/testing.md). Token id 0 is a token (SmolLM2's
``<|endoftext|>``); a tensor of exactly ``min_dim`` dimensions passes; the defaults take a 0-d tensor
and a NaN; a CUDA device is refused in words that say why, on a machine without CUDA as on one with
fewer GPUs than asked (``torch.cuda`` stood in for, since CI has no GPU)."""

from __future__ import annotations

import pytest
import torch

from kvlens.checks import check_device, check_tensor, check_token_ids


def test_token_id_zero_and_the_last_id_are_tokens():
    assert check_token_ids([0, 9], 10) == [0, 9]
    assert check_token_ids(torch.tensor([0]), 10) == [0]
    with pytest.raises(ValueError, match=r"token ids\[0\] = 10 is outside the vocabulary \[0, 10\)"):
        check_token_ids([10], 10)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float16, torch.complex64])
def test_a_tensor_of_no_integer_dtype_is_named_by_its_dtype(dtype):
    with pytest.raises(TypeError, match=f"token ids must be an integer tensor, got dtype {dtype}"):
        check_token_ids(torch.zeros(2, dtype=dtype), 10)


def test_check_tensor_defaults_take_any_tensor():
    scalar = torch.tensor(float("nan"))
    assert check_tensor(scalar, "x") is scalar  # 0-d and NaN: neither is refused unless asked


def test_check_tensor_min_dim_is_inclusive():
    x = torch.zeros(2, 3)
    assert check_tensor(x, "x", min_dim=2) is x
    with pytest.raises(ValueError, match=r"x must have at least 3 dimension\(s\), got shape \(2, 3\)"):
        check_tensor(x, "x", min_dim=3)


def test_check_tensor_names_every_dtype_it_takes():
    with pytest.raises(
        TypeError, match=r"^x must have dtype torch.float32 or torch.float16, got torch.int64$"
    ):
        check_tensor(torch.zeros(1, dtype=torch.int64), "x", dtypes=(torch.float32, torch.float16))


@pytest.fixture
def cuda(monkeypatch):
    """torch.cuda as a build with ``gpus`` visible GPUs (0: CUDA built in, none visible) reports it."""

    def fake(gpus: int, built: bool = True) -> None:
        monkeypatch.setattr(torch.version, "cuda", "12.4" if built else None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)

    return fake


@pytest.mark.parametrize(
    "built, words",
    [(False, "this torch build has no CUDA"), (True, "no CUDA GPU is visible")],
)
def test_cuda_without_a_gpu_says_why(cuda, built, words):
    cuda(0, built)
    with pytest.raises(ValueError, match=f"^device 'cuda' is not available: {words}$"):
        check_device("cuda")


def test_a_gpu_index_past_the_last_is_refused(cuda):
    cuda(2)
    assert check_device("cuda") == torch.device("cuda")
    assert check_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"^device 'cuda:2' does not exist: 2 CUDA GPU\(s\)$"):
        check_device("cuda:2")
