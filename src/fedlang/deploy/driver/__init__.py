"""The training side, over the admin API: `context.DeploymentContext` runs a computation
with each wave of aggregations as a round (`rounds.ServerRounds` against a server,
`context.LocalRounds` in this process); `buffered.BufferedDriver` runs a FedBuff session;
`admin.Admin` is the admin endpoints.
"""
