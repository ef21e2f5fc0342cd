"""Rotating the control token (docs/sidecar.md, "Rotating the control token"): the sidecar re-reads its
token file when it changes, whether kubelet swaps the Secret volume's `..data` symlink or the file is
rewritten in place; an empty or missing file keeps the token in force. Against the whole sidecar
(server.serve) with a token file laid out as kubelet mounts a Secret."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from specserve_testing.inprocess_sidecar import RunningSidecar


def mount_secret(volume: Path, token: str, generation: int) -> None:
    """Kubelet's atomic update of a Secret volume: a new timestamped dir, then `..data` swapped to it by
    renaming a fresh symlink over it; `token` itself is a symlink into `..data`."""
    volume.mkdir(exist_ok=True)
    data = volume / f"..2026_11_30_{generation:02d}"
    data.mkdir()
    (data / "token").write_text(token)
    tmp = volume / "..data_tmp"
    tmp.symlink_to(data.name)
    old = os.readlink(volume / "..data") if (volume / "..data").is_symlink() else None
    os.replace(tmp, volume / "..data")
    if not (volume / "token").is_symlink():
        (volume / "token").symlink_to("..data/token")
    if old is not None:
        for f in (volume / old).iterdir():
            f.unlink()
        (volume / old).rmdir()


async def status_with(sidecar: RunningSidecar, token: str) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.get(sidecar.url + "/v1/state", headers={"Authorization": f"Bearer {token}"}) as resp,
    ):
        return resp.status


async def test_a_swapped_secret_volume_takes_effect_at_once(
    start_sidecar: Callable[..., Awaitable[RunningSidecar]], tmp_path: Path
) -> None:
    volume = tmp_path / "control-token"
    mount_secret(volume, "first-token\n", 1)
    sidecar = await start_sidecar(tokenFile=str(volume / "token"))
    assert await status_with(sidecar, "first-token") == 200
    mount_secret(volume, "second-token\n", 2)
    assert await status_with(sidecar, "second-token") == 200
    assert await status_with(sidecar, "first-token") == 401
    mount_secret(volume, "third-token", 3)
    assert await status_with(sidecar, "third-token") == 200


async def test_a_rewritten_file_takes_effect_and_a_broken_one_keeps_the_token(
    start_sidecar: Callable[..., Awaitable[RunningSidecar]], tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("first-token")
    sidecar = await start_sidecar(tokenFile=str(token_file))
    assert await status_with(sidecar, "first-token") == 200
    token_file.write_text("rewritten-token")  # in place: same inode
    assert await status_with(sidecar, "rewritten-token") == 200
    assert await status_with(sidecar, "first-token") == 401
    token_file.write_text("")  # emptied (a half-written update): the token in force stays
    assert await status_with(sidecar, "rewritten-token") == 200
    assert await status_with(sidecar, "") == 401
    token_file.unlink()  # gone: the same
    assert await status_with(sidecar, "rewritten-token") == 200
    token_file.write_text("back-token\n")
    assert await status_with(sidecar, "back-token") == 200
