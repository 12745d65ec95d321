"""Devices in tests: the devices a test runs on here, and a CI guard for code that must run on any
device: every tensor it creates names its device.

On a GPU, a tensor made with ``torch.arange(h)`` lands on the CPU while the data it meets is on
the GPU ("Expected all tensors to be on the same device"): the MNIST zoo's random crops crashed on
CUDA that way, and a CPU-only CI cannot see it. ``explicit_devices()`` makes it visible on a CPU:
inside it, a tensor factory (``torch.arange``, ``zeros``, ``tensor``, ``randn``, ... the factories
that ``torch.set_default_device`` redirects) called from the project's own code without a
``device=`` raises ``ImplicitDeviceError`` naming the file and line. A factory that draws from a
``generator`` is exempt (its device is the generator's, chosen on purpose: the data order of every
network comes from a CPU generator so that it is the same on every device). Library code (torch,
laplace-torch, BLiTZ) is not checked, nor a factory that library code calls on the project's behalf
(``nn.Linear`` building its weight on the CPU before the module is moved).

Device-facing code then says where each tensor goes: ``device=images.device`` for what meets the
data, ``device="cpu"`` for bookkeeping that stays on the host.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

REPO = Path(__file__).resolve().parent.parent
PROJECT = tuple(str(REPO / package) + "/" for package in ("benchmark", "methods", "metrics"))


class ImplicitDeviceError(AssertionError):
    """A tensor factory in the project's code was called without ``device=``."""


_DISPATCH = ("/torch/overrides.py", "/torch/utils/_device.py")


def _caller(depth: int = 2) -> tuple[str, int]:
    """The file and line that called the factory: the first frame outside this module and torch's
    dispatch of ``__torch_function__`` (a factory called inside torch itself, e.g. by ``nn.Linear``
    building its weight on the CPU before the caller moves the module, names torch's file)."""
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name == __file__ or name.endswith(_DISPATCH)):
            return name, frame.f_lineno
        frame = frame.f_back
    return "?", 0


class _ExplicitDevices(TorchFunctionMode):
    def __init__(self, also: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.factories = _device_constructors()
        self.checked = PROJECT + tuple(also)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.factories and kwargs.get("device") is None and kwargs.get("generator") is None:
            name, line = _caller()
            if name.startswith(self.checked):
                where = Path(name).relative_to(REPO)
                raise ImplicitDeviceError(
                    f"{where}:{line}: torch.{func.__name__}(...) without device=; on a GPU it would be made on the "
                    "CPU while the data is on the GPU (pass device=<the data's device>, or device='cpu' on purpose)")
        return func(*args, **kwargs)


@contextlib.contextmanager
def explicit_devices(also: tuple[str, ...] = ()) -> Iterator[None]:
    """Inside the block, the project's tensor factories must name their device (module docstring);
    ``also``: more source files (or folders, ending in ``/``) held to the rule."""
    with _ExplicitDevices(also):
        yield


def available_devices() -> list[str]:
    """The devices a device-comparing test runs on here: the CPU, and CUDA where there is one."""
    return ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
