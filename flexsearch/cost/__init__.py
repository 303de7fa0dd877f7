"""The cost model: hardware specs as data (:mod:`.hardware`), per-kind efficiency
factors (:mod:`.efficiency`), roofline/measured compute cost (:mod:`.compute`) and
alpha-beta communication cost (:mod:`.comm`)."""

from flexsearch.cost.comm import (
    ALGORITHMS,
    CommCost,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    collective,
    exchange,
    p2p_time,
    parameter_server,
    reduce_scatter,
)
from flexsearch.cost.compute import (
    MeasuredCosts,
    OpCost,
    Partition,
    Work,
    backward_work,
    forward_work,
    node_dtype,
    op_cost,
    roofline_time,
)
from flexsearch.cost.efficiency import EfficiencyTable, load_efficiency
from flexsearch.cost.hardware import (
    Cluster,
    ClusterSpec,
    DeviceSpec,
    Link,
    available_presets,
    load_cluster_spec,
    save_cluster_spec,
)

__all__ = [
    "ALGORITHMS",
    "Cluster",
    "ClusterSpec",
    "CommCost",
    "DeviceSpec",
    "EfficiencyTable",
    "Link",
    "MeasuredCosts",
    "OpCost",
    "Partition",
    "Work",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "available_presets",
    "backward_work",
    "broadcast",
    "collective",
    "exchange",
    "forward_work",
    "load_cluster_spec",
    "load_efficiency",
    "node_dtype",
    "op_cost",
    "p2p_time",
    "parameter_server",
    "reduce_scatter",
    "roofline_time",
    "save_cluster_spec",
]
