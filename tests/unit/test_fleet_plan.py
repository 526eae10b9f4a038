"""Fleet-scale planning (gearshift.planner.fleetplan): the bounds hold the exact optimum, plans are feasible.

The exact optimum of each tiny fleet is found here by brute force, independently of the planner: every
subset of the units, every way to split it into pipelines, every order of each pipeline's units and every
split of the layers, at every micro-batch size. The plan's feasibility (memory per card, the 70% link rule,
micro-batch limits, the SLO, the card budget) is recomputed here from the stages alone.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from gearshift.facts.fleet import FleetError, parse_fleet
from gearshift.planner import LINK_CAP, InfeasibleError, LayerCosts, PlanInputError
from gearshift.planner.fleetbound import bound_cheapest, bound_max_load
from gearshift.planner.fleetclasses import FleetAnswer, FleetClasses, UnitClass, Workload, fleet_classes
from gearshift.planner.fleetpeer import peer_cheapest, peer_max_load
from gearshift.planner.fleetplan import cheapest, max_load

REPO = Path(__file__).resolve().parents[2]
MIXED = str(REPO / "examples" / "fleets" / "mixed.yaml")
UTIL = 0.8  # the workload's utilisation below; brute force and plan count load the same way


@dataclass(frozen=True)
class ToyModel:
    """A cost model of ``L`` layers whose micro-batches of ``m`` cost ``base·m^0.6`` (batching pays) and
    whose pass (latency share) is a fixed share of compute, smaller on the last layer (like an LM head)."""

    L: int = 6
    weight_gb: float = 9.0
    activation_mb: float = 40.0

    @property
    def name(self) -> str:
        return "toy"

    def at(self, micro_batch: int, decode_batch: int | None = None) -> LayerCosts:
        f = micro_batch**0.6
        compute = [10.0 * f] * self.L
        compute[-1] = 14.0 * f
        latency = [3.0 * micro_batch**0.8] * self.L
        latency[-1] = 3.2 * micro_batch**0.8
        return LayerCosts(
            "toy",
            self.activation_mb * micro_batch,
            tuple(compute),
            (self.weight_gb,) * self.L,
            (1.0,) * self.L,
            micro_batch,
            tuple(latency),
        )


def _fleet(pools: Sequence[tuple[str, int, float]], price: bool = False) -> FleetClasses:
    doc = {
        "name": "tiny",
        "nodePools": [
            {
                "name": f"p{i}",
                "gpu": gpu,
                "nodes": n,
                "gpusPerNode": 1,
                "nicGbps": nic,
                **({"pricePerGpuHour": 1.0 + i} if price else {}),
            }
            for i, (gpu, n, nic) in enumerate(pools)
        ],
    }
    return fleet_classes(parse_fleet(doc))


# --------------------------------------------------------------------------------------------
# Brute force (independent of the planner)


def _pipeline_best(units: tuple[UnitClass, ...], wl: Workload) -> float:
    """Most req/s (at the utilisation) of one pipeline using exactly ``units``; 0 when none fits."""
    best = 0.0
    L = wl.model.at(1).num_layers
    for m in wl.micro_batches:
        if any(m > u.max_micro_batch for u in units):
            continue
        c = wl.model.at(m)
        for order in set(itertools.permutations(units)):
            for cuts in itertools.combinations(range(1, L), len(order) - 1):
                bounds = (0, *cuts, L)
                t, lat, ok = 0.0, 0.0, True
                for k, u in enumerate(order):
                    a, b = bounds[k], bounds[k + 1]
                    if sum(c.memory_gb(i) for i in range(a, b)) > u.memory_gb + 1e-9:
                        ok = False
                        break
                    t = max(t, sum(c.compute_ms[a:b]) / u.score)
                    lat += sum(c.pass_ms[a:b]) / u.score
                    if k:
                        gbps = min(order[k - 1].nic_gbps, u.nic_gbps)
                        t = max(t, c.activation_mb * 8 / gbps / LINK_CAP)
                        lat += c.activation_mb * 8 / gbps + max(order[k - 1].latency_us, u.latency_us) / 1000
                if ok and (wl.slo_ms is None or lat <= wl.slo_ms):
                    best = max(best, UTIL * 1000.0 * m / t)
    return best


def _partitions(items: tuple[int, ...]) -> Iterator[list[tuple[int, ...]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [(first,), *part]
        for i in range(len(part)):
            yield [*part[:i], (first, *part[i]), *part[i + 1 :]]


def _brute(fc: FleetClasses, wl: Workload) -> dict[tuple[int, ...], float]:
    """For every subset of the units (by index): the most req/s of pipelines using all of them."""
    units = [c for c in fc.classes for _ in range(c.count)]

    @cache
    def block(idx: tuple[int, ...]) -> float:
        return _pipeline_best(tuple(units[i] for i in idx), wl)

    out = {}
    for r in range(1, len(units) + 1):
        for subset in itertools.combinations(range(len(units)), r):
            best = -math.inf
            for part in _partitions(subset):
                vals = [block(b) for b in part]
                if all(v > 0 for v in vals):
                    best = max(best, sum(vals))
            out[subset] = best
    return out


def _optimum_max(fc: FleetClasses, wl: Workload) -> float:
    return max(_brute(fc, wl).values())


def _optimum_cost(fc: FleetClasses, wl: Workload, target: float) -> float:
    units = [c for c in fc.classes for _ in range(c.count)]
    costs = [sum(units[i].price for i in s) for s, v in _brute(fc, wl).items() if v >= target]
    return min(costs) if costs else math.inf


# --------------------------------------------------------------------------------------------
# Independent feasibility check of a plan


def _check_feasible(fc: FleetClasses, wl: Workload, ans: FleetAnswer) -> None:
    used: dict[str, int] = {}
    load = 0.0
    for p in ans.pipelines:
        c = wl.model.at(p.micro_batch)
        assert p.stages[0][0] == 0 and p.stages[-1][1] == c.num_layers
        t, lat = 0.0, 0.0
        prev: UnitClass | None = None
        for a, b, name in p.stages:
            u = fc.by_name(name)
            assert u.tp == p.tp and p.micro_batch <= u.max_micro_batch
            assert sum(c.memory_gb(i) for i in range(a, b)) <= u.memory_gb + 1e-9, "memory per card"
            t = max(t, sum(c.compute_ms[a:b]) / u.score)
            lat += sum(c.pass_ms[a:b]) / u.score
            if prev is not None:
                gbps = min(prev.nic_gbps, u.nic_gbps)
                # 70% rule: the activation of one micro-batch per bottleneck uses ≤ 70% of the link
                assert c.activation_mb * 8 / gbps <= LINK_CAP * p.bottleneck_ms * (1 + 1e-9)
                lat += c.activation_mb * 8 / gbps + max(prev.latency_us, u.latency_us) / 1000
            prev = u
            used[u.pool] = used.get(u.pool, 0) + u.tp * p.count
        assert p.bottleneck_ms >= t * (1 - 1e-9)
        assert p.latency_ms == pytest.approx(lat)
        if wl.slo_ms is not None:
            assert lat <= wl.slo_ms * (1 + 1e-9)
        assert p.throughput_rps == pytest.approx(UTIL * 1000.0 * p.micro_batch / p.bottleneck_ms)
        load += p.throughput_rps * p.count
    assert ans.throughput_rps == pytest.approx(load)
    for pool, n in used.items():
        assert n <= fc.cards[pool], f"pool {pool} over its cards"


TINY = [
    [("H100-80GB", 1, 100.0), ("T4-16GB", 3, 25.0)],
    [("A100-40GB", 2, 100.0), ("A10-24GB", 2, 25.0)],
    [("H100-80GB", 1, 200.0), ("A10-24GB", 1, 25.0), ("T4-16GB", 2, 10.0)],
    [("L40S-48GB", 2, 50.0), ("T4-16GB", 2, 25.0)],
]


def _workloads() -> list[Workload]:
    model = ToyModel()
    return [
        Workload(model, None, UTIL, (1, 2, 4)),
        Workload(model, 80.0, UTIL, (1, 2, 4)),
        Workload(model, 200.0, UTIL, (1, 4)),
    ]


class TestBoundHoldsTheOptimum:
    @pytest.mark.parametrize("pools", TINY)
    @pytest.mark.parametrize("wl", _workloads(), ids=["no-slo", "slo-80", "slo-200"])
    def test_max_load(self, pools, wl):
        fc = _fleet(pools)
        opt = _optimum_max(fc, wl)
        bound = bound_max_load(fc, wl)
        assert opt > 0
        assert bound >= opt * (1 - 1e-9)
        ans = max_load(fc, wl)
        _check_feasible(fc, wl, ans)
        assert ans.throughput_rps <= opt * (1 + 1e-9)  # a feasible plan cannot beat the optimum
        assert ans.ratio == pytest.approx(ans.throughput_rps / bound)

    @pytest.mark.parametrize("pools", TINY)
    @pytest.mark.parametrize("share", [0.3, 0.7])
    def test_cheapest(self, pools, share):
        fc = _fleet(pools, price=True)
        wl = _workloads()[1]
        target = _optimum_max(fc, wl) * share
        opt = _optimum_cost(fc, wl, target)
        bound = bound_cheapest(fc, wl, target)
        assert bound <= opt * (1 + 1e-9)
        ans = cheapest(fc, wl, target)
        _check_feasible(fc, wl, ans)
        assert ans.throughput_rps >= target * (1 - 1e-9)
        assert ans.cost >= opt * (1 - 1e-9)
        assert ans.ratio == pytest.approx(ans.cost / bound)


class TestTheCostBoundCountsWholePipelines:
    """Each (micro-batch, TP) group of a plan holds whole pipelines, each with a copy of the model: without
    that the cost bound let a fraction of one H200 (141 GB, the 70B model at TTFT 1,500 ms needs ~146 GB)
    serve the last req/s beside two 4-GPU units, a bound of 9 GPUs (bench/results/planner_fleet.json,
    gen-64-4c-70s-6402); the least any plan pays is 10."""

    def test_the_bound_meets_the_plan_where_one_card_cannot_hold_the_model(self):
        from gearshift.planner import load_model

        fleet = {
            "name": "gen-64-4c-70s-6402",
            "nodePools": [
                {"name": "p0-v100", "gpu": "V100-32GB", "nodes": 5, "gpusPerNode": 4, "nicGbps": 25},
                {"name": "p1-l4", "gpu": "L4-24GB", "nodes": 2, "gpusPerNode": 4, "nicGbps": 25},
                {"name": "p2-t4", "gpu": "T4-16GB", "nodes": 17, "gpusPerNode": 1, "nicGbps": 10},
                {"name": "p3-h200", "gpu": "H200-141GB", "nodes": 2, "gpusPerNode": 8, "nicGbps": 100},
            ],
        }
        fc = fleet_classes(parse_fleet(fleet))
        wl = Workload(load_model(REPO / "examples" / "models" / "llama-3-70b.json"), 1500.0)
        h200 = fc.by_name("p3-h200")
        assert h200.memory_gb < sum(wl.model.at(1).memory_gb(i) for i in range(wl.model.at(1).num_layers))
        target = max_load(fc, wl).throughput_rps / 2
        cheap = cheapest(fc, wl, target)
        _check_feasible(fc, wl, cheap)
        assert cheap.throughput_rps >= target
        # The bound meets the plan, so the plan is optimal.
        assert cheap.bound == pytest.approx(10.0) and cheap.cost == pytest.approx(10.0)


class TestPlanOnLargerFleets:
    def test_feasible_and_under_the_bound_on_a_random_fleet(self):
        rng = random.Random(5)
        gpus = ["H100-80GB", "A100-40GB", "A10-24GB", "T4-16GB", "L4-24GB"]
        pools = [
            {"name": f"p{i}", "gpu": g, "nodes": rng.randint(2, 6), "gpusPerNode": rng.choice([1, 2, 4])}
            for i, g in enumerate(gpus)
        ]
        fc = fleet_classes(parse_fleet({"name": "r", "nodePools": pools}))
        wl = Workload(ToyModel(L=24, weight_gb=3.0), 200.0, UTIL)
        ans = max_load(fc, wl)
        _check_feasible(fc, wl, ans)
        assert 0 < ans.throughput_rps <= ans.bound * (1 + 1e-9)
        cheap = cheapest(fc, wl, ans.throughput_rps / 2)
        _check_feasible(fc, wl, cheap)
        assert cheap.cost >= cheap.bound * (1 - 1e-9)
        assert cheap.throughput_rps >= ans.throughput_rps / 2 * (1 - 1e-9)

    def test_peer_never_beats_the_bound(self):
        fc = _fleet([("H100-80GB", 3, 100.0), ("T4-16GB", 8, 25.0)])
        wl = _workloads()[2]
        peer = peer_max_load(fc, wl)
        assert peer is not None
        assert peer[0] <= bound_max_load(fc, wl) * (1 + 1e-9)
        target = peer[0] / 2
        cheap_peer = peer_cheapest(fc, wl, target)
        assert cheap_peer is not None and cheap_peer[0] >= target
        assert cheap_peer[1] >= bound_cheapest(fc, wl, target) * (1 - 1e-9)


class TestClassesAndErrors:
    def test_tp_classes_share_the_pool_cards(self):
        fc = fleet_classes(
            parse_fleet(
                {"name": "f", "nodePools": [{"name": "a", "gpu": "A10-24GB", "nodes": 3, "gpusPerNode": 4}]}
            )
        )
        assert sorted((c.tp, c.count, c.memory_gb) for c in fc.classes) == [
            (1, 12, 24),
            (2, 6, 48),
            (4, 3, 96),
        ]
        assert fc.cards == {"a": 12}
        assert fc.cost_unit == "GPUs"

    def test_price_for_an_unknown_class_names_the_known_ones(self):
        fleet = parse_fleet({"name": "f", "nodePools": [{"name": "a", "gpu": "A10-24GB", "nodes": 1}]})
        with pytest.raises(PlanInputError, match=r"B200.*known: A10-24GB, a"):
            fleet_classes(fleet, {"B200": 3.0})

    def test_prices_for_some_pools_only(self):
        doc = {
            "name": "f",
            "nodePools": [
                {"name": "a", "gpu": "A10-24GB", "nodes": 1, "pricePerGpuHour": 0.8},
                {"name": "b", "gpu": "T4-16GB", "nodes": 1},
            ],
        }
        with pytest.raises(PlanInputError, match=r"pools b have no price"):
            fleet_classes(parse_fleet(doc))
        fc = fleet_classes(parse_fleet(doc), {"T4-16GB": 0.4})
        assert fc.cost_unit == "price/h"
        assert {c.name: c.price for c in fc.classes} == {"a": 0.8, "b": 0.4}

    def test_bad_price_in_the_fleet_file(self):
        with pytest.raises(FleetError, match=r"nodePools\[0\].pricePerGpuHour must be a finite number > 0"):
            parse_fleet(
                {
                    "name": "f",
                    "nodePools": [{"name": "a", "gpu": "T4-16GB", "nodes": 1, "pricePerGpuHour": 0}],
                }
            )

    def test_impossible_load_names_the_bound(self):
        fc = _fleet([("H100-80GB", 1, 100.0)])
        wl = _workloads()[0]
        top = bound_max_load(fc, wl)
        with pytest.raises(InfeasibleError, match=r"impossible on this fleet.*lower --load"):
            cheapest(fc, wl, top * 1.5)

    def test_nothing_meets_the_slo(self):
        fc = _fleet([("T4-16GB", 6, 25.0)])
        with pytest.raises(InfeasibleError, match=r"SLO"):
            max_load(fc, Workload(ToyModel(), 1.0, UTIL, (1,)))


class TestCli:
    MODEL = str(REPO / "examples" / "models" / "llama-3-8b.json")

    def _run(self, capsys, *args: str) -> tuple[int, str, str]:
        from gearshift.cli import main

        rc = main(["plan", "--fleet", "--model", self.MODEL, *args])
        out, err = capsys.readouterr()
        return rc, out, err

    def test_json_carries_bound_and_ratio_per_answer(self, capsys, tmp_path):
        import json

        fleet = tmp_path / "f.yaml"
        fleet.write_text(
            "name: f\nnodePools:\n"
            "  - {name: h, gpu: H100-80GB, nodes: 2, gpusPerNode: 4, nicGbps: 100}\n"
            "  - {name: t, gpu: T4-16GB, nodes: 4, gpusPerNode: 4, nicGbps: 25}\n"
        )
        rc, out, _ = self._run(
            capsys, "--cluster", str(fleet), "--slo-ms", "800", "--load", "20", "-o", "json"
        )
        assert rc == 0
        doc = json.loads(out)
        for key in ("max_load", "cheapest"):
            ans = doc[key]
            assert ans["bound"] > 0
            assert ans["ratio"] == pytest.approx(
                (ans["throughput_rps"] if key == "max_load" else ans["cost"]) / ans["bound"], rel=1e-4
            )
        assert doc["max_load"]["ratio"] <= 1 + 1e-6 <= doc["cheapest"]["ratio"] + 2e-6
        assert doc["cheapest"]["throughput_rps"] >= 20 * (1 - 1e-6)
        assert doc["gpus"] == 24

    def test_table_prints_both_answers_and_the_ratio(self, capsys):
        rc, out, _ = self._run(capsys, "--cluster", MIXED)
        assert rc == 0
        assert "max load:" in out and "cheapest for" in out
        assert out.count("plan / bound") == 2

    def test_fleet_file_with_a_missing_field_names_it(self, capsys, tmp_path):
        fleet = tmp_path / "f.yaml"
        fleet.write_text("name: f\nnodePools:\n  - {name: h, nodes: 2}\n")
        rc, _, err = self._run(capsys, "--cluster", str(fleet))
        assert rc == 1
        assert "nodePools[0].gpu is required" in err

    def test_fleet_options_without_fleet_are_refused(self, capsys):
        from gearshift.cli import main

        rc = main(["plan", "--cluster", MIXED, "--model", self.MODEL, "--load", "5"])
        assert rc == 2
        assert "--load answer the fleet-scale questions: add --fleet" in capsys.readouterr().err

    @pytest.mark.parametrize(
        ("flags", "needle"),
        [
            (["--slo-ms", "0"], "give a finite time above 0 ms, e.g. --slo-ms 1500"),
            (["--slo-ms", "nan"], "give a finite time above 0 ms, e.g. --slo-ms 1500"),
            (["--load", "-5"], "give a finite load above 0 req/s, e.g. --load 10"),
        ],
    )
    def test_bad_fleet_numbers_name_their_flag(self, capsys, flags, needle):
        with pytest.raises(SystemExit) as info:
            self._run(capsys, "--cluster", MIXED, *flags)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flags[0]}" in err and needle in err

    def test_gear_flags_with_fleet_are_refused(self, capsys):
        rc, _, err = self._run(capsys, "--cluster", MIXED, "--itl-ms", "50", "--gear", "latency")
        assert rc == 2
        assert "--gear, --itl-ms plan gears and mean nothing with --fleet" in err

    def test_an_empty_cluster_file_says_so(self, capsys, tmp_path):
        empty = tmp_path / "empty.yaml"
        empty.write_text("")
        listed = tmp_path / "list.yaml"
        listed.write_text("- a\n- b\n")
        rc, _, err = self._run(capsys, "--cluster", str(empty))
        assert rc == 1 and "empty.yaml' is empty: give a mapping with 'nodes'" in err
        rc, _, err = self._run(capsys, "--cluster", str(listed))
        assert rc == 1 and "is a list, not a mapping" in err

    def test_bad_price_item(self, capsys):
        rc, _, err = self._run(capsys, "--cluster", MIXED, "--price", "T4-16GB")
        assert rc == 1
        assert "write CLASS=PRICE" in err


class TestGearSetPlannerOnLargePools:
    """Large pools (beyond the exact partitioner's state cap) get their gears from the fleet-scale planner."""

    def _profile(self, per_class: int):
        from gearshift.planner import parse_profile

        kinds = [("h", 80.0, 1.0, 200.0), ("a", 40.0, 0.32, 100.0), ("t", 16.0, 0.07, 25.0)]
        nodes = [
            {"node_id": f"{k}{i}", "memory_gb": mem, "compute_score": score, "max_batch_microbatch": 16}
            for k, mem, score, _ in kinds
            for i in range(per_class)
        ]
        nic = {f"{k}{i}": bw for k, _, _, bw in kinds for i in range(per_class)}
        for x, a in enumerate(nodes):
            a["interconnect"] = {
                b["node_id"]: {"bandwidth_gbps": min(nic[a["node_id"]], nic[b["node_id"]]), "latency_us": 10}
                for b in nodes[x + 1 :]
            }
        return parse_profile({"nodes": nodes})

    def test_large_pool_is_detected_by_the_partitioners_cap(self):
        from gearshift.planner.candidates import large_pool as _large_pool

        assert _large_pool(self._profile(110))
        assert not _large_pool(self._profile(5))

    def test_throughput_gear_is_feasible_and_uses_the_fleet(self):
        from gearshift.planner import plan
        from gearshift.planner.fleetclasses import profile_classes

        profile = self._profile(110)
        model = ToyModel(L=24, weight_gb=3.0)
        gear = plan(profile, model, intents=("throughput",), sim_requests=200).gear("throughput")
        costs = model.at(gear.micro_batch)
        assert gear.stages[0].layers[0] == 0 and gear.stages[-1].layers[1] == costs.num_layers
        seen: set[str] = set()
        for st in gear.stages:
            a, b = st.layers
            need = sum(costs.memory_gb(i) for i in range(a, b))
            for n in st.nodes:
                assert profile.node(n).memory_gb >= need - 1e-9
                assert n not in seen  # a node holds one stage of one pipeline
                seen.add(n)
        # The gear is one template replicated: at least the fleet planner's best group of pipelines at its
        # micro-batch (whose load is counted at the utilisation).
        best = max_load(profile_classes(profile), Workload(model, None, micro_batches=(gear.micro_batch,)))
        top_group = max(p.throughput_rps * p.count for p in best.pipelines) / UTIL
        assert gear.predicted.throughput_rps >= top_group * (1 - 1e-6)
