"""Layer 4: the canary inside a serving engine.

`contract` (what an engine hands the manager, as typing.Protocols), `manager` (CanaryManager: the
buffers of one engine and the step protocol), `drain` (reading the violation ring without stalling
a step), `config` (SGLang's options), `monitor` (stats line, health check), `reporting` and
`violations` (decoding and reporting rows), `metrics` (Prometheus) and `distributed` (the fleet
decision across ranks). Metrics and the fleet attach to a manager as listeners. Imports only the
layers below (`launch`, `backends`, `layer`).
"""
