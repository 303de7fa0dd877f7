"""The simulator: one training iteration of any strategy as tasks on devices and links.

:func:`flexsearch.sim.predict.predict` is the one entry point (graph, strategy, cost
context -> :class:`~flexsearch.sim.result.Simulation`); :mod:`.context` holds the
explicit cost context, :mod:`.accounting` the memory and update rules every simulator
shares, :mod:`.tasks` the list scheduler, and :mod:`.simulator` (op level),
:mod:`.stages` / :mod:`.pipeline` (pipelines) and :mod:`.decentralized` (gossip) the
task graphs of each plan kind.
"""
