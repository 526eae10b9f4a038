"""The adaptive batch, pure: :mod:`.pd_balance` is the rule the router computes per decode pod (and its
PD rebalancing); :mod:`.tick` applies it to the serving gear's ``maxNumSeqs``. The handler is
:mod:`gearshift.handlers.adaptive_batch`.
"""
