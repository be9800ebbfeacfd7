"""The job runtime: the scan queue's intake, leased scan workers, `gpubadge worker`'s process,
the attachments beside reports, and the serve process's garbage collection. No HTTP: web/ sits
above it and calls it; it never imports web/.
"""
