"""The gear controller, pure: :mod:`.tick` (what one shifting tick sees and does) over :mod:`.policy`
(the numbers, from the GearSet's ``spec.policy`` through :mod:`.adapt`), :mod:`.decide` (one sample →
keep, shift or roll back, with :mod:`.triggers`, :mod:`.capacity` and :mod:`.cost`), the level-triggered
shift :mod:`.executor` (its :mod:`.executor_actions`; :mod:`.executor_sim` runs it over a world model),
and the status codecs :mod:`.executor_status` and :mod:`.shift_status`. The handler is
:mod:`gearshift.handlers.shifting`.
"""
