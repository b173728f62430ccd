"""Services a Bus runs beside its loops, each supervised
(:mod:`~nmbus.maintenance.supervise`): restarted with a backoff when it fails."""
