-- The newest jobs in given states (`queries.jobs(states=…)`: the scans page's pending list, the image list's
-- recent failures, GET /api/scans?state=) read every job in those states and sorted them: 37 ms for the scans
-- page at 100,000 queued jobs (the queue's cap). With (state, created_at), each state's newest are a range
-- read in order, and the query stops at the page's size in each.
CREATE INDEX jobs_state_created ON jobs (state, created_at);
