-- PostgreSQL's 0003 adds a trigram search index; SQLite searches by scanning (fast at its scale),
-- so this step only keeps the two engines' version numbers in step.
SELECT 1;
