-- PostgreSQL's 0013 adds a trigram index on the names tags give a digest; SQLite searches by scanning
-- (fast at its scale), so this step only keeps the two engines' version numbers in step.
SELECT 1;
