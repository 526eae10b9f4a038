"""The pipeline-replica autoscaler, pure: :mod:`.scaling` is the algorithm over plain numbers
(HPA-style recommendation, stabilisation windows, GPU packing); :mod:`.tick` maps it onto GearSets and
their pods. The handler is :mod:`gearshift.handlers.autoscale`.
"""
