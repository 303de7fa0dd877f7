"""The searches: the planner (:mod:`.planner`) runs them all over one graph and cluster.

:mod:`.baselines` (the lower bound and the recipes simulated), :mod:`.ilp` /
:mod:`.assignment` (exact CP-SAT seed), :mod:`.mcmc` (FlexFlow's SOAP search),
:mod:`.partition` / :mod:`.pipeline` (PipeDream's DP and pipeline layouts),
:mod:`.decentralized` (D-PSGD topologies and parameter servers), :mod:`.results` (a
searched strategy as a plan). Every candidate is predicted by
:func:`flexsearch.sim.predict.predict`.
"""
