"""The profile file: msgspec Structs for JSON version 1, `load_profile`, `save_profile`.

Unknown fields and out-of-range values are refused on load, with the JSON path of the first
offender in the message (`ProfileFormatError`). What a hand-written profile (a test's) may
leave out has a default: measured_at, the server's descriptive fields (not max_total_tokens),
prefill_batch, kv_transfer and switch ([]), drain (null). `save_profile` always writes every field.
"""

from __future__ import annotations

import os
import tempfile
from typing import Annotated, Any, Literal, Optional

import msgspec

VERSION = 1
MODES = ("null", "prefill", "decode")

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0.0)]
Mode = Literal["null", "prefill", "decode"]


class ProfileFormatError(ValueError):
    """A profile file or dict that is not a valid version-1 profile."""


class _Struct(msgspec.Struct, forbid_unknown_fields=True):
    pass


class ServerInfo(_Struct, kw_only=True):
    url: str = ""
    model: str = ""
    quantization: str = ""
    dtype: str = ""
    torch_threads: NonNegativeInt = 0
    cpu_flags: list[str] = []
    page_size: PositiveInt = 1
    max_total_tokens: PositiveInt
    max_running_requests: NonNegativeInt = 0  # the server's running-batch limit; 0: not recorded
    prefill_step_tokens: NonNegativeInt = 0  # the most new tokens one prefill step takes; 0: not recorded
    transfer_backend: str = ""


class PrefillPoint(_Struct):
    tokens: PositiveInt
    seconds: NonNegativeFloat


class PrefillBatchPoint(_Struct):
    """`batch` prompts of `tokens` new tokens each, prefilled together in one step."""
    batch: Annotated[int, msgspec.Meta(ge=2)]
    tokens: PositiveInt
    seconds: NonNegativeFloat


class DecodePoint(_Struct):
    batch: PositiveInt
    context_tokens: NonNegativeInt
    step_seconds: NonNegativeFloat


class KVTransferPoint(_Struct):
    tokens: PositiveInt
    bytes: NonNegativeInt
    seconds: NonNegativeFloat


class SwitchPoint(_Struct):
    src: Mode
    dst: Mode
    seconds: NonNegativeFloat


class Drain(_Struct):
    seconds_idle: NonNegativeFloat


class Profile(_Struct, kw_only=True):
    version: int
    measured_at: str = ""
    server: ServerInfo
    prefill: list[PrefillPoint]
    prefill_batch: list[PrefillBatchPoint] = []
    decode: list[DecodePoint]
    kv_transfer: list[KVTransferPoint] = []
    switch: list[SwitchPoint] = []
    drain: Optional[Drain] = None


def check_profile(p: Profile) -> Profile:
    """What the types cannot say: the version, and enough points to interpolate."""
    if p.version != VERSION:
        raise ProfileFormatError(f"unsupported profile version {p.version} (this tidal reads version {VERSION})")
    if not p.prefill:
        raise ProfileFormatError("the profile has no prefill points")
    if not p.decode:
        raise ProfileFormatError("the profile has no decode points")
    return p


def profile_error(flag: str, path: str, error: Exception) -> str:
    """`flag path: what is wrong`, the path said once (a ProfileFormatError names the file already)."""
    return f"{flag}: {error}" if str(path) in str(error) else f"{flag} {path}: {error}"


def profile_from_dict(d: Any) -> Profile:
    try:
        return check_profile(msgspec.convert(d, Profile))
    except msgspec.ValidationError as e:
        raise ProfileFormatError(f"not a tidal profile: {e}") from None


def load_profile(path: str) -> Profile:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ProfileFormatError(f"cannot read profile {path}: {e.strerror or e}") from None
    try:
        return check_profile(msgspec.json.decode(data, type=Profile))
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ProfileFormatError(f"{path}: not a tidal profile: {e}") from None
    except ProfileFormatError as e:
        raise ProfileFormatError(f"{path}: {e}") from None


def save_profile(profile: Profile, path: str) -> None:
    """Writes indented JSON atomically (a reader never sees half a file)."""
    data = msgspec.json.format(msgspec.json.encode(check_profile(profile)), indent=2) + b"\n"
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
