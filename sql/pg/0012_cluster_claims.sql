-- The claim's rules move into the claim (store_pg.py: _ROOM, _SERVES, _ELSEWHERE), which reads
-- each node's project and provider lists once per statement; as functions they were evaluated
-- for every candidate row of every claim, a node's room counting every run of its threads.
DROP FUNCTION t3_may_take(TEXT, TEXT);
DROP FUNCTION t3_room(TEXT);
DROP FUNCTION t3_serves(TEXT, TEXT);
