"""What a client runs, and what the server checks it against: pure, no I/O.

* `round`: a round's plan (`RoundPlan`): the client task and the aggregations its
  report pre-aggregates;
* `compiler`: splitting a traced computation into those plans, a wave at a time
  (`build`), refusing what real clients cannot run (`DeploymentError`);
* `buffered`: a buffered (FedBuff) session's plan (`BufferedPlan`): one client trains
  one model version; an edge's batch of such reports;
* `folding`: checking one client's report (or an edge's partial aggregate) and folding
  it into a round's aggregate;
* `execution`: running a round's task on a client's own data;
* `cache`: signed plans, verified and parsed once.
"""
