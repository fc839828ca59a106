"""Local zones: FLEETSERVE_LOCAL_ZONES parsing with its bounds, capacity bookkeeping, and
preemption of real replica processes (newest first) when a zone's spot capacity falls."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fleetserve.core.errors import InvalidSpec
from fleetserve.infra.base import InstanceKind
from fleetserve.infra.local import LocalInfra, processes_with_token
from fleetserve.infra.zones import Held, NoCapacity, ZoneBook, ZoneConfig, parse_zones
from tests.unit.infra.ids import HOME_A

from .test_local import get, request


def test_zones_inline_with_capacities_and_prices() -> None:
    zones = parse_zones("zone-a:spot=2:od=4, zone-b:spot_price=0.5,zone-c:spot=unlimited")
    assert [z.name for z in zones] == ["zone-a", "zone-b", "zone-c"]
    assert (zones[0].spot, zones[0].od) == (2, 4)
    assert zones[1].spot is None and zones[1].spot_price == 0.5
    assert zones[2].spot is None
    assert parse_zones(None) == [ZoneConfig("local")]
    assert parse_zones("") == [ZoneConfig("local")]


def test_zones_from_a_yaml_file(tmp_path: Path) -> None:
    f = tmp_path / "zones.yaml"
    f.write_text("zones:\n  - {name: us-a, spot: 1}\n  - {name: us-b, od: 0, od_price: 9}\n")
    zones = parse_zones(str(f))
    assert [(z.name, z.spot, z.od, z.od_price) for z in zones] == [
        ("us-a", 1, None, 3.06),
        ("us-b", None, 0, 9.0),
    ]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("a,a", "declared twice"),
        ("A", "zone name"),
        ("a:spot=-1", "0..10000"),
        ("a:spot=20000", "0..10000"),
        ("a:spot=1.5", "not a whole number"),
        ("a:spot", "key=value"),
        ("a:gpus=1", "unknown key 'gpus'"),
        ("a:spot_price=nan", "0..1000000"),
        ("a:od_price=-1", "0..1000000"),
        (",".join(f"z{i}" for i in range(65)), "at most 64"),
        (" , ", "declares no zone"),
        ("/nonexistent/zones.yaml", "not a file"),
    ],
)
def test_bad_zone_declarations_name_what_is_wrong(value: str, words: str) -> None:
    with pytest.raises(InvalidSpec, match=words):
        parse_zones(value)


def test_a_zones_file_of_the_wrong_shape_or_size_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "zones.yaml"
    f.write_text("zone-a: 1\n")
    with pytest.raises(InvalidSpec, match="list of zones"):
        parse_zones(str(f))
    f.write_text("- {name: a}\n" * 20_000)
    with pytest.raises(InvalidSpec, match="over"):
        parse_zones(str(f))


def test_capacity_bookkeeping_and_newest_first_preemption() -> None:
    book = ZoneBook([ZoneConfig("a", spot=2, od=1, od_price=5), ZoneConfig("b", od_price=3)])
    for i, since in enumerate((1.0, 3.0)):
        assert book.place("a", spot=True) == "a"
        book.held[f"t{i}"] = Held("svc", i, "a", True, since, 100 + i)
    with pytest.raises(NoCapacity, match="no spot capacity in zone a") as e:
        book.place("a", spot=True)
    assert e.value.zone == "a"
    assert book.place(None, spot=False) == "b"  # on demand: the cheapest zone with room
    victims = book.set_spot_capacity("a", 1)
    assert [t for t, _ in victims] == ["t1"]  # the newest goes first
    assert book.set_spot_capacity("a", None) == []
    with pytest.raises(InvalidSpec):
        book.set_spot_capacity("a", -1)
    with pytest.raises(Exception, match="not one of"):
        book.place("nowhere", spot=True)


async def test_a_zone_losing_capacity_kills_its_newest_spot_replica_which_polls_lost(
    tmp_path: Path,
) -> None:
    infra = LocalInfra(
        tmp_path / "home",
        grace_seconds=2,
        home_id=HOME_A,
        zones=[ZoneConfig("za", spot=2), ZoneConfig("zb")],
    )
    old = await infra.launch(request(tmp_path, "tok-old", replica_id=1, spot=True, zone="za"))
    await asyncio.sleep(0.05)
    new = await infra.launch(request(tmp_path, "tok-new", replica_id=2, spot=True, zone="za"))
    od = await infra.launch(request(tmp_path, "tok-od", replica_id=3))
    assert (old.zone, new.zone, od.zone) == ("za", "za", "za")
    assert await get(old.port) == "1 hi"
    with pytest.raises(NoCapacity):
        await infra.launch(request(tmp_path, "tok-3", replica_id=4, spot=True, zone="za"))
    lost = infra.set_spot_capacity("za", 1)
    assert [h.replica_id for h in lost] == [2]
    await asyncio.sleep(0.3)
    state = await infra.poll(new.handle)
    assert state.kind is InstanceKind.LOST and "spot capacity fell to 1" in state.detail
    assert not [p for p in processes_with_token("tok-new") if p.is_running()]
    assert (await infra.poll(old.handle)).kind is InstanceKind.RUNNING
    assert (await infra.poll(od.handle)).kind is InstanceKind.RUNNING  # on demand: untouched
    # By hand: one replica of the service, wherever it is.
    assert [h.replica_id for h in infra.preempt("svc", replica_id=3)] == [3]
    assert [h.replica_id for h in infra.preempt("svc", zone="za")] == [1]
    for launched, token in ((old, "tok-old"), (new, "tok-new"), (od, "tok-od")):
        await infra.terminate(launched.handle, token)
    assert infra.zones.held == {}
