"""Operations over the port (:mod:`~nmbus.ports.operations`): :class:`~nmbus.ops.admin.Admin`,
behind the command line and the dashboard."""
