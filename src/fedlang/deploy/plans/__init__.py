"""What a client runs, and what the server checks it against: pure, no I/O.

* `round`: a round's plan (`RoundPlan`), split from a traced computation: the client
  task and the aggregations its report pre-aggregates;
* `buffered`: a buffered (FedBuff) session's plan (`BufferedPlan`): one client trains
  one model version;
* `folding`: checking one client's report and folding it into a round's aggregate;
* `execution`: running a round's task on a client's own data;
* `cache`: signed plans, verified and parsed once.
"""
