"""The task store: durable state in SQL (SQLite or PostgreSQL), never HTTP.

* `sql`: the two dialects and a transaction's connection;
* `schema`: every table, the schema version and the migrations between versions;
* `values`: values of any size (blobs, aggregates), kept in chunks, read in ranges;
* `store`: connections, populations, clients, blobs, counters: what every mode shares;
* `admission`: the checks every mode makes of an upload (replay, conflict, not
  assigned, closed);
* `rounds`, `secure`, `sessions`: plain rounds, secure rounds (SecAgg+), buffered
  (FedBuff) sessions.
"""
