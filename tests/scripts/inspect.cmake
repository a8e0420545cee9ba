# kvtier-inspect census on the real configs in tests/data/models: byte counts of docs/design.md
# §1 in the text and --json forms, and a non-zero exit for a missing file and a bad flag.
if(TARGET kvtier-inspect)
  set(KVT_MODELS ${KVT_MODELS_DIR})
  set(KVT_KIMI ${KVT_MODELS}/kimi-linear-48b-a3b-instruct.json)
  set(KVT_DSV3 ${KVT_MODELS}/deepseek-v3.json)

  add_test(NAME inspect_census_kimi
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI} --ratio 32)
  set_tests_properties(inspect_census_kimi PROPERTIES PASS_REGULAR_EXPRESSION
    "26 +mla-nope +576 x bf16 = 1152 B +policy salience\nkv bytes per token: 8,064 B/token.*dense cache +264,241,152 B.*~252 B/token")

  add_test(NAME inspect_census_kimi_1_indexed
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI})
  set_tests_properties(inspect_census_kimi_1_indexed PROPERTIES PASS_REGULAR_EXPRESSION
    "0-2 +no-kv +\\(KDA\\) +policy none\n +3 +mla-nope")

  add_test(NAME inspect_census_kimi_concurrency
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI} --context 32768 --concurrency 32)
  set_tests_properties(inspect_census_kimi_concurrency PROPERTIES PASS_REGULAR_EXPRESSION
    "dense cache +8,455,716,864 B \\(8\\.5 GB\\)")

  # 32 requests of 32768 tokens sharing their first 30720 (a long system prompt): the dense
  # cache 32 x 32768 - 31 x 30720 = 96,256 rows of 8,064 B, the prefix held once.
  add_test(NAME inspect_census_kimi_shared_prefix
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI} --context 32768 --concurrency 32 --shared-prefix 30720)
  set_tests_properties(inspect_census_kimi_shared_prefix PROPERTIES PASS_REGULAR_EXPRESSION
    "dense cache +8,455,716,864 B.*first 30,720 tokens shared.*dense cache +776,208,384 B")
  add_test(NAME inspect_census_bad_shared_prefix
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI} --context 100 --shared-prefix 101)
  set_tests_properties(inspect_census_bad_shared_prefix PROPERTIES WILL_FAIL TRUE)

  add_test(NAME inspect_census_deepseek
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_DSV3})
  set_tests_properties(inspect_census_deepseek PROPERTIES PASS_REGULAR_EXPRESSION
    "0-60 +mla-rope +576 x bf16 = 1152 B +policy random-evict.*kv bytes per token: 70,272 B/token")

  add_test(NAME inspect_census_deepseek_fp32
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_DSV3} --dtype fp32)
  set_tests_properties(inspect_census_deepseek_fp32 PROPERTIES PASS_REGULAR_EXPRESSION
    "kv bytes per token: 140,544 B/token")

  add_test(NAME inspect_census_kimi_json
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI} --json --ratio 32)
  set_tests_properties(inspect_census_kimi_json PROPERTIES PASS_REGULAR_EXPRESSION
    "\"kv_bytes_per_token\": 8064,.*\"index\": 3,\n +\"kind\": \"mla-nope\",\n +\"policy\": \"salience\".*\"dense_bytes\": 264241152,\n +\"attended_bytes\": 8257536,\n +\"freed_bytes\": 0")

  add_test(NAME inspect_census_deepseek_json
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_DSV3} --json)
  set_tests_properties(inspect_census_deepseek_json PROPERTIES PASS_REGULAR_EXPRESSION
    "\"kv_bytes_per_token\": 70272,.*\"index\": 60,\n +\"kind\": \"mla-rope\",\n +\"policy\": \"random-evict\"")

  # Failures: non-zero exit (WILL_FAIL) and a one-line error naming the problem.
  add_test(NAME inspect_census_missing_file
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_MODELS}/no-such-config.json)
  set_tests_properties(inspect_census_missing_file PROPERTIES WILL_FAIL TRUE)
  add_test(NAME inspect_census_missing_file_message
    COMMAND ${CMAKE_COMMAND} -E env $<TARGET_FILE:kvtier-inspect> census ${KVT_MODELS}/no-such-config.json)
  set_tests_properties(inspect_census_missing_file_message PROPERTIES
    PASS_REGULAR_EXPRESSION "kvtier-inspect census: .*no-such-config.json: cannot open")

  add_test(NAME inspect_census_bad_flag
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI} --frobnicate)
  set_tests_properties(inspect_census_bad_flag PROPERTIES WILL_FAIL TRUE)
  add_test(NAME inspect_census_bad_ratio
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI} --ratio 0.5)
  set_tests_properties(inspect_census_bad_ratio PROPERTIES WILL_FAIL TRUE)
  add_test(NAME inspect_census_bad_dtype
    COMMAND $<TARGET_FILE:kvtier-inspect> census ${KVT_KIMI} --dtype int4)
  set_tests_properties(inspect_census_bad_dtype PROPERTIES WILL_FAIL TRUE)
  add_test(NAME inspect_unknown_command
    COMMAND $<TARGET_FILE:kvtier-inspect> frobnicate)
  set_tests_properties(inspect_unknown_command PROPERTIES WILL_FAIL TRUE)
endif()

# kvtier-inspect trace on the golden traces of tests/golden (make_golden.py): the values the
# script writes (layers 3 and 7 of 27, prompt 6, needles, targets, row bytes from pattern()), the
# --verify / --json / --rows forms, and one-line errors with the reader's message for broken files.
if(TARGET kvtier-inspect)
  set(KVT_GOLDEN ${PROJECT_SOURCE_DIR}/tests/golden)
  set(KVT_INSPECT_BIN $<TARGET_FILE:kvtier-inspect>)

  add_test(NAME inspect_trace_mla
    COMMAND ${KVT_INSPECT_BIN} trace ${KVT_GOLDEN}/mla_bf16.kvtt)
  set_tests_properties(inspect_trace_mla PROPERTIES PASS_REGULAR_EXPRESSION
    "format: 1\\.0\nprompt rows: 6\nmodel layers: 27\nprovenance: 49 bytes, 3 lines\n  \\| generator=make_golden\\.py\n.*traced layers: 2\n  layer 3: mla-nope, policy salience, 2 query heads\n    rows     1 plane x 1 KV head x 1152 B \\(576 x bf16: 512 value \\| 64 branch bf16 at byte 1024\\) = 1,152 B/token\n    tokens   20 .*queries  3 steps, bf16, 2 heads x 576, positions 16\\.\\.20\n  layer 7: .*queries  1 step, fp32, 2 heads x 576.*needles: 2\n  #0 layer 3 rows \\[9, 11\\)\n  #1 layer 7 rows \\[14, 15\\)\ntargets: 2\n  #0 layer 3 step 1 -> needle 0, heads 0 1\n  #1 layer 7 step 0 -> needle 1, head 1\n")

  add_test(NAME inspect_trace_mla_verify
    COMMAND ${KVT_INSPECT_BIN} trace ${KVT_GOLDEN}/mla_bf16.kvtt --verify)
  set_tests_properties(inspect_trace_mla_verify PROPERTIES PASS_REGULAR_EXPRESSION
    "\nverify: OK")

  # Token 9 of layer 3 = bytes 9*1152.. of pattern(1030, ...) in make_golden.py.
  add_test(NAME inspect_trace_mla_rows
    COMMAND ${KVT_INSPECT_BIN} trace ${KVT_GOLDEN}/mla_bf16.kvtt --rows 3:9:2 --rows=7:0:1)
  set_tests_properties(inspect_trace_mla_rows PROPERTIES PASS_REGULAR_EXPRESSION
    "rows of layer 3 \\[9, 11\\), first 32 of 1152 B per row[^\n]*\n  token 9 plane 0 head 0: 20 04 55 a4 5a 02 a2 67 [0-9a-f ]+ \\.\\.\\.\n  token 10 plane 0 head 0: fe 20 3d 3b .*rows of layer 7 \\[0, 1\\)")

  add_test(NAME inspect_trace_gqa
    COMMAND ${KVT_INSPECT_BIN} trace ${KVT_GOLDEN}/gqa_2plane.kvtt --verify --rows 0:0:1)
  set_tests_properties(inspect_trace_gqa PROPERTIES PASS_REGULAR_EXPRESSION
    "layer 0: gqa-rope, policy random-evict, 4 query heads\n    rows     2 planes \\(K, V\\) x 2 KV heads x 16 B \\(8 x fp16\\) = 64 B/token.*layer 1: .*queries  none.*verify: OK.*token 0 plane 1 head 1: [0-9a-f ]+\n")

  add_test(NAME inspect_trace_unknown_sections
    COMMAND ${KVT_INSPECT_BIN} trace ${KVT_GOLDEN}/unknown_section.kvtt --verify)
  set_tests_properties(inspect_trace_unknown_sections PROPERTIES PASS_REGULAR_EXPRESSION
    "format: 1\\.7\n.*verify: OK")

  add_test(NAME inspect_trace_mla_json
    COMMAND ${KVT_INSPECT_BIN} trace ${KVT_GOLDEN}/mla_bf16.kvtt --json --verify --rows 3:9:1)
  set_tests_properties(inspect_trace_mla_json PROPERTIES PASS_REGULAR_EXPRESSION
    "\"format\": {\n +\"major\": 1,\n +\"minor\": 0\n +},\n +\"prompt_rows\": 6,\n +\"n_model_layers\": 27,.*\"layer\": 3,\n +\"kind\": \"mla-nope\",\n +\"policy\": \"salience\",.*\"n_tokens\": 20,\n +\"queries\": {\n +\"n_steps\": 3,\n +\"dtype\": \"bf16\",\n +\"n_heads\": 2,\n +\"dim\": 576.*\"needles\": \\[\n +{\n +\"id\": 0,\n +\"layer\": 3,\n +\"first_row\": 9,\n +\"n_rows\": 2.*\"heads\": \\[\n +0,\n +1\n +\\].*\"verify\": {\n +\"ok\": true\n +},\n +\"rows\": \\[.*\"hex\": \"20 04 55 a4")

  # Failures: exit status, exactly one line on stderr and its text, checked by a small script
  # (PASS_REGULAR_EXPRESSION alone would ignore the exit status). ARGS separates words with '|'.
  set(KVT_INSPECT_EXPECT ${CMAKE_CURRENT_BINARY_DIR}/inspect_expect.cmake)
  file(WRITE ${KVT_INSPECT_EXPECT} [=[
string(REPLACE "|" ";" args "${ARGS}")
execute_process(COMMAND ${BIN} ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc STREQUAL "${RC}")
  message(FATAL_ERROR "exit status ${rc}, expected ${RC}; stderr: ${err}")
endif()
string(REGEX MATCHALL "\n" nl "${err}")
list(LENGTH nl n_lines)
if(NOT n_lines EQUAL 1 OR NOT err MATCHES "^kvtier-inspect trace: [^\n]*\n$")
  message(FATAL_ERROR "expected one 'kvtier-inspect trace: ...' line on stderr, got: ${err}")
endif()
if(NOT err MATCHES "${ERR}")
  message(FATAL_ERROR "stderr does not match '${ERR}': ${err}")
endif()
if(DEFINED OUT AND NOT out MATCHES "${OUT}")
  message(FATAL_ERROR "stdout does not match '${OUT}': ${out}")
endif()
]=])
  function(kvt_inspect_trace_fails name rc err_re args)
    add_test(NAME inspect_trace_${name}
      COMMAND ${CMAKE_COMMAND} -DBIN=$<TARGET_FILE:kvtier-inspect> "-DARGS=${args}"
              -DRC=${rc} "-DERR=${err_re}" ${ARGN} -P ${KVT_INSPECT_EXPECT})
  endfunction()
  kvt_inspect_trace_fails(bad_magic 1 "broken_bad_magic\\.kvtt: bad magic.*KVT_ERR_PARSE"
    "trace|${KVT_GOLDEN}/broken_bad_magic.kvtt")
  kvt_inspect_trace_fails(crc_meta 1 "CRC mismatch.*KVT_ERR_CORRUPT"
    "trace|${KVT_GOLDEN}/broken_crc_meta.kvtt")
  # A flipped row byte passes open (row CRCs are checked on full reads) and fails --verify.
  add_test(NAME inspect_trace_crc_rows_open
    COMMAND ${KVT_INSPECT_BIN} trace ${KVT_GOLDEN}/broken_crc_rows.kvtt)
  kvt_inspect_trace_fails(crc_rows_verify 1
    "CRC mismatch in section 4 \\(ROWS, type 4\\) at offset 296.*KVT_ERR_CORRUPT"
    "trace|${KVT_GOLDEN}/broken_crc_rows.kvtt|--verify" "-DOUT=\nverify: FAILED\n$")
  kvt_inspect_trace_fails(crc_rows_verify_json 1 "CRC mismatch in section 4.*KVT_ERR_CORRUPT"
    "trace|${KVT_GOLDEN}/broken_crc_rows.kvtt|--verify|--json"
    "-DOUT=\"verify\": {\n +\"ok\": false,\n +\"status\": \"KVT_ERR_CORRUPT\"")
  kvt_inspect_trace_fails(trunc_rows 1 "truncated section 4.*KVT_ERR_PARSE"
    "trace|${KVT_GOLDEN}/broken_trunc_rows.kvtt")
  kvt_inspect_trace_fails(trunc_no_end 1 "no END section.*KVT_ERR_PARSE"
    "trace|${KVT_GOLDEN}/broken_trunc_no_end.kvtt")
  kvt_inspect_trace_fails(empty 1 "truncated file header.*KVT_ERR_PARSE"
    "trace|${KVT_GOLDEN}/broken_empty.kvtt")
  kvt_inspect_trace_fails(major2 1 "version 2\\.0.*KVT_ERR_UNSUPPORTED"
    "trace|${KVT_GOLDEN}/broken_major2.kvtt")
  kvt_inspect_trace_fails(missing_file 1 "cannot open .*no-such\\.kvtt.*KVT_ERR_IO"
    "trace|${KVT_GOLDEN}/no-such.kvtt")
  kvt_inspect_trace_fails(rows_layer 1 "--rows: layer 4 is not in"
    "trace|${KVT_GOLDEN}/mla_bf16.kvtt|--rows|4:0:1")
  kvt_inspect_trace_fails(rows_range 1 "--rows: rows \\[19, 21\\) past the 20 rows of layer 3"
    "trace|${KVT_GOLDEN}/mla_bf16.kvtt|--rows|3:19:2")
  kvt_inspect_trace_fails(rows_bad 2 "--rows: expected LAYER:FIRST:N"
    "trace|${KVT_GOLDEN}/mla_bf16.kvtt|--rows|3:0:65")
  kvt_inspect_trace_fails(bad_flag 2 "unknown flag '--frob'"
    "trace|${KVT_GOLDEN}/mla_bf16.kvtt|--frob")
  kvt_inspect_trace_fails(no_file 2 "missing FILE" "trace")
endif()
