"""The data at the doors between the engine's layers: plain msgspec structs, never a live
object, so each door can become a process boundary (the engine core's already is; a
multi-host engine sends the runner's inputs to every host).

- engine_core.py: the front end and the engine core (EngineCoreRequest in, EngineCoreOutputs out).
- step.py: the scheduler and the model runner (SchedulerOutput and TokenMasks in, ModelRunnerOutput out).
"""
