"""The GPUs this process can see: model, compute capability, memory, driver.

Probed without creating a CUDA context where possible (nvidia-smi, which every NVIDIA driver installs),
because callers may run before torchrun starts its workers; torch.cuda is the last resort and has no
driver version.
"""

from __future__ import annotations

import os
import shutil
import subprocess

NVIDIA_SMI_TIMEOUT_S = 10.0
_SMI_FIELDS = "name,compute_cap,memory.total,driver_version"


def probe_gpus() -> dict:
    """{"source", "count", "devices": [{name, compute_capability, memory_mib, driver_version}], "notes"}."""
    notes: list[str] = []
    for source, probe in (
        ("nvidia-smi", _probe_nvidia_smi),
        ("torch.cuda", _probe_torch),
    ):
        devices, note = probe()
        if devices is not None:
            return _result(source, devices, notes)
        notes.append(f"{source}: {note}")
    return _result(None, [], notes)


def _result(source: str | None, devices: list[dict], notes: list[str]) -> dict:
    return {
        "source": source,
        "count": len(devices),
        "devices": devices,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "notes": notes,
    }


def _probe_nvidia_smi() -> tuple[list[dict] | None, str]:
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return None, "not on PATH"
    try:
        done = subprocess.run(
            [executable, f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"no answer within {NVIDIA_SMI_TIMEOUT_S:.0f} s"
    except OSError as error:
        return None, f"cannot run ({error.strerror})"
    if done.returncode != 0:
        first_line = next(iter((done.stdout + done.stderr).strip().splitlines()), "")
        return None, f"exit {done.returncode}: {first_line}"
    try:
        return parse_nvidia_smi(done.stdout), ""
    except ValueError:
        return None, f"unexpected output {done.stdout.strip()[:80]!r}"


def parse_nvidia_smi(csv_text: str) -> list[dict]:
    """Rows of `name, compute_cap, memory.total [MiB], driver_version` (csv, noheader, nounits)."""
    devices = []
    for line in csv_text.strip().splitlines():
        name, capability, memory, driver = (field.strip() for field in line.rsplit(",", 3))
        devices.append(_device(name, capability, int(memory) if memory.isdigit() else None, driver))
    return devices


def _probe_torch() -> tuple[list[dict] | None, str]:
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA device available"
    devices = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        devices.append(
            _device(
                properties.name, f"{properties.major}.{properties.minor}", properties.total_memory >> 20, None
            )
        )
    return devices, ""


def _device(name: str, capability: str, memory_mib: int | None, driver: str | None) -> dict:
    return {
        "name": name,
        "compute_capability": capability,
        "memory_mib": memory_mib,
        "driver_version": driver,
    }
