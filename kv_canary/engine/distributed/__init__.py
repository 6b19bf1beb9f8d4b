"""Canaries across ranks: the fleet decision and fleet stats over a torch.distributed process group
(kv_canary.engine.distributed.fleet), and a launcher for local gloo ranks (kv_canary.demo.local_ranks)."""
from .collective import FleetCollectiveError
from .fleet import FleetHealthError, FleetMonitor, FleetViolationError
from .rows import FleetDecision, FleetStats, RankReport, StatsSample

__all__ = ("FleetMonitor", "FleetViolationError", "FleetHealthError", "FleetCollectiveError", "FleetDecision",
           "FleetStats", "RankReport", "StatsSample")
