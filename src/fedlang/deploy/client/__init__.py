"""A device: `client.Client` pulls tasks, runs them on its own data and uploads reports;
`connection.Connection` is HTTP to the server with retries (the driver uses it too). A
client imports the wire contract (`protocol`) and the plans, never the server or store.
"""
