"""Strategies: the vocabulary the simulator, the plan, the searches and the emitter share.

Small immutable values and pure functions over them, with no dependency on how a
strategy is costed, searched or run:

- :mod:`.config`: one op's parallel configuration (``Config``, its text form) and the
  emitter rule (``legal``, ``follow``);
- :mod:`.space`: decision units of a graph and the expansion of decisions into every
  node's configuration;
- :mod:`.recipes`: named strategies (data parallel, Megatron, FlexFlow's expert plan)
  and a hybrid stage's tensor-parallel layout;
- :mod:`.schedules`: pipeline schedules as sequences of actions;
- :mod:`.topology`: gossip topologies of decentralized training;
- :mod:`.fsdp`: the FSDP units a sharded data-parallel plan wraps;
- :mod:`.kinds`: one value per plan kind, what the simulator predicts and the planner
  returns.
"""
