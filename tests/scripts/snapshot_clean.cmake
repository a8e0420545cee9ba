# kvtier-inspect snapshot --clean DIR on real files: a stale temporary of a killed writer
# (kvtier content, old) goes, a young one and a foreign file stay, the count is printed.
if(TARGET kvtier-inspect)
  add_test(NAME inspect_snapshot_clean
    COMMAND sh -c "d=$(mktemp -d) && printf '\\211KVT' > $d/s.kvts.tmp.Ab3dE9 && \
touch -d '2 hours ago' $d/s.kvts.tmp.Ab3dE9 && : > $d/s.kvts.tmp.Young1 && \
printf other > $d/notes.tmp.Other1 && touch -d '2 hours ago' $d/notes.tmp.Other1 && \
$<TARGET_FILE:kvtier-inspect> snapshot --clean $d && test ! -e $d/s.kvts.tmp.Ab3dE9 && \
test -e $d/s.kvts.tmp.Young1 && test -e $d/notes.tmp.Other1 && \
$<TARGET_FILE:kvtier-inspect> snapshot --clean $d --min-age 0 && test ! -e $d/s.kvts.tmp.Young1 && \
rm -r $d && echo clean-ok")
  set_tests_properties(inspect_snapshot_clean PROPERTIES PASS_REGULAR_EXPRESSION
    "1 stale temporary removed.*1 stale temporary removed.*clean-ok")
endif()
