"""What a worker tells about itself: Prometheus metrics (:mod:`~nmbus.telemetry.metrics`)
and OpenTelemetry spans (:mod:`~nmbus.telemetry.tracing`, loaded only when the
``otel`` extra is installed, through :mod:`~nmbus.telemetry.tracer`)."""
