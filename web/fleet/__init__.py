"""The live fleet the service keeps in memory: agents' liveness, GPU owners and placement's index
(`live_fleet`), and the agents' held long polls (`long_polls`)."""
