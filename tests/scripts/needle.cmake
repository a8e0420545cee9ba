# kvtier-needle's command-line rules (docs/needle.md, "Running it"): list values are parsed whole
# (no fixed buffer that cuts a long value and parses the cut item as another value), empty items
# and over-long lists are refused, and the flags of the synthetic haystack are refused with
# --trace instead of being ignored. Each case checks the exit status, and for a refusal exactly
# one 'kvtier-needle: ...' line on stderr naming the flag and nothing on stdout (nothing ran).
# The runs that do replay use 4k haystacks or the 20-row golden trace: about a second each.
if(TARGET kvtier-needle)
  set(KVT_GOLDEN ${PROJECT_SOURCE_DIR}/tests/golden)
  set(KVT_NEEDLE_EXPECT ${CMAKE_CURRENT_BINARY_DIR}/needle_expect.cmake)
  # ARGS separates words with '|'. RC: expected exit status. ERR (refusals): regex the one stderr
  # line must match. OUT / NOT_OUT: regexes stdout must / must not match.
  file(WRITE ${KVT_NEEDLE_EXPECT} [=[
string(REPLACE "|" ";" args "${ARGS}")
execute_process(COMMAND ${BIN} ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc STREQUAL "${RC}")
  message(FATAL_ERROR "exit status ${rc}, expected ${RC}; stderr: ${err}\nstdout: ${out}")
endif()
if(DEFINED ERR)
  string(REGEX MATCHALL "\n" nl "${err}")
  list(LENGTH nl n_lines)
  if(NOT n_lines EQUAL 1 OR NOT err MATCHES "^kvtier-needle: [^\n]*\n$")
    message(FATAL_ERROR "expected one 'kvtier-needle: ...' line on stderr, got: ${err}")
  endif()
  if(NOT err MATCHES "${ERR}")
    message(FATAL_ERROR "stderr does not match '${ERR}': ${err}")
  endif()
  if(NOT out STREQUAL "")
    message(FATAL_ERROR "a refused command line printed on stdout: ${out}")
  endif()
endif()
if(DEFINED OUT AND NOT out MATCHES "${OUT}")
  message(FATAL_ERROR "stdout does not match '${OUT}': ${out}")
endif()
if(DEFINED NOT_OUT AND out MATCHES "${NOT_OUT}")
  message(FATAL_ERROR "stdout matches '${NOT_OUT}': ${out}")
endif()
]=])
  function(kvt_needle_cli name rc args)
    add_test(NAME needle_cli_${name}
      COMMAND ${CMAKE_COMMAND} -DBIN=$<TARGET_FILE:kvtier-needle> "-DARGS=${args}" -DRC=${rc}
              ${ARGN} -P ${KVT_NEEDLE_EXPECT})
  endfunction()

  # 1. Long lists. The old parser copied a list into a 1024-byte buffer (256 for --mode and
  # --salience) and split it there. 200 zeros + "8," + 819 zeros + "128" is 1,024 characters: the
  # copy kept 1,023 and the run used ratios 8 and 12. All of it must be read: ratios 8 and 128.
  string(REPEAT "0" 200 z200)
  string(REPEAT "0" 819 z819)
  kvt_needle_cli(long_ratio_list 0
    "--context|4k|--ratio|${z200}8,${z819}128|--no-progress"
    "-DOUT=\nsalience +no +strong +4k +8 [^\n]*\nsalience +no +strong +4k +128 "
    "-DNOT_OUT= 4k +12[^0-9]")
  # One item longer than the old buffer: 1,100 zeros then "0.9" was cut to zeros, depth 0.
  string(REPEAT "0" 1100 z1100)
  kvt_needle_cli(long_depth_item 0
    "--context|4k|--depth|${z1100}0.9|--verbose|--no-progress"
    "-DOUT=\nsalience +no +4k +strong +32 +0\\.900 " "-DNOT_OUT= 0\\.000[^0-9]")
  # Empty items are refused, not skipped. The old parser skipped them (strtok) and cut the value
  # at 255 characters: 247 commas + "salience,dense" ran salience alone, dropping dense.
  string(REPEAT "," 247 c247)
  kvt_needle_cli(long_mode_list 2 "--mode|${c247}salience,dense"
    "-DERR=bad --mode '[,]+salience,dense': item 1 is empty")
  string(REPEAT "," 249 c249)
  kvt_needle_cli(long_salience_list 2 "--salience|${c249}strong,weak"
    "-DERR=bad --salience '[,]+strong,weak': item 1 is empty")
  kvt_needle_cli(empty_ratio_item 2 "--ratio|8,,32" "-DERR=bad --ratio '8,,32': item 2 is empty")
  kvt_needle_cli(trailing_comma 2 "--depth|0.2,0.8," "-DERR=bad --depth '0\\.2,0\\.8,': item 3 is empty")
  # 65 items: more than a list holds (64) is refused, not dropped.
  string(REPEAT "8," 64 r64)
  kvt_needle_cli(too_many_ratios 2 "--ratio|${r64}8" "-DERR=bad --ratio '[8,]+': more than 64 items")
  kvt_needle_cli(bad_mode_item 2 "--mode|salience,bogus"
    "-DERR=bad --mode 'salience,bogus': item 2 'bogus'")
  # A ratio is a uint32_t: 2^32 + 8 was accepted by --grid-ratios and became 8.
  kvt_needle_cli(grid_ratio_range 2 "--grid|--grid-ratios|8,4294967304"
    "-DERR=bad --grid-ratios '8,4294967304': item 2 is 4294967304 \\(1\\.\\.2\\^20\\)")

  # 2. Flags of the synthetic haystack with --trace: refused naming the flag, before or after
  # --trace (they used to be ignored: the run replayed the trace as if they were not there).
  foreach(fv context:8k depth:0.5 needles:2 needle-rows:2 salience:weak heads:4 target-heads:1
             kv-haystack:0.1 rope prompt-rows:16 dtype:fp16 seeds:2 grid-contexts:8k
             grid-depths:0.5)
    string(REPLACE ":" "|" words "--${fv}")
    string(REGEX REPLACE ":.*" "" flag "${fv}")
    kvt_needle_cli(trace_refuses_${flag} 2 "--trace|${KVT_GOLDEN}/mla_bf16.kvtt|${words}"
      "-DERR=--${flag} shapes the synthetic haystack and does not apply to --trace")
  endforeach()
  kvt_needle_cli(trace_refuses_flag_before_trace 2
    "--context|8k|--trace|${KVT_GOLDEN}/mla_bf16.kvtt"
    "-DERR=--context shapes the synthetic haystack")
  # --layer is the mirror case: it selects a trace layer and is refused without --trace.
  kvt_needle_cli(layer_needs_trace 2 "--layer|3" "-DERR=--layer applies to --trace only")
  kvt_needle_cli(layer_needs_trace_last_source_wins 2
    "--trace|${KVT_GOLDEN}/mla_bf16.kvtt|--layer|3|--synthetic"
    "-DERR=--layer applies to --trace only")
  # The flags that do apply to a trace (layer, manager, pass rule, kvtier seed, --grid's ratio
  # axis) still run it, and the last of --trace / --synthetic still decides the source.
  kvt_needle_cli(trace_keeps_its_flags 0
    "--trace|${KVT_GOLDEN}/mla_bf16.kvtt|--layer|3|--ratio|8,32|--mode|salience,random,dense|--seed|3|--block|64|--kappa|4|--sinks|2|--recent|16|--scale|0.1|--min-mass|0.5|--min-cos|0.5|--grid|--csv|${CMAKE_CURRENT_BINARY_DIR}/needle_cli_trace.csv|--no-progress"
    "-DOUT=mla_bf16\\.kvtt; pass = mass_ratio >= 0\\.5 and out_cos >= 0\\.5.*\ndense +no +trace +20 +1 .*pass 0/0\n$")
  kvt_needle_cli(synthetic_after_trace 0
    "--trace|${KVT_GOLDEN}/mla_bf16.kvtt|--synthetic|--context|4k|--no-progress"
    "-DOUT=kvtier-needle: synthetic;.*\nsalience +no +strong +4k +32 .*pass 1/1\n$")
endif()

# The guarded-device backend gives the same CSV as the CPU backend (its pool is closed to the
# host outside the backend's ops; the replay reads it through kvt_layer_read).
if(TARGET kvtier-needle)
  set(KVT_NEEDLE_SAME ${CMAKE_CURRENT_BINARY_DIR}/needle_same_backend.cmake)
  file(WRITE ${KVT_NEEDLE_SAME} [=[
set(common --synthetic --context 8192 --ratio 8,32 --mode salience,random,dense --needles 2 --seed 3)
execute_process(COMMAND ${BIN} ${common} --csv ${DIR}/needle_cpu.csv RESULT_VARIABLE a OUTPUT_QUIET)
execute_process(COMMAND ${BIN} ${common} --backend guarded --csv ${DIR}/needle_guarded.csv
                RESULT_VARIABLE b OUTPUT_QUIET)
if(NOT a EQUAL 0 OR NOT b EQUAL 0)
  message(FATAL_ERROR "exit statuses ${a} (cpu) and ${b} (guarded)")
endif()
file(READ ${DIR}/needle_cpu.csv x)
file(READ ${DIR}/needle_guarded.csv y)
if(NOT x STREQUAL y OR x STREQUAL "")
  message(FATAL_ERROR "the guarded backend's CSV differs from the CPU backend's")
endif()
]=])
  add_test(NAME needle_guarded_same_csv
    COMMAND ${CMAKE_COMMAND} -DBIN=$<TARGET_FILE:kvtier-needle> -DDIR=${CMAKE_CURRENT_BINARY_DIR}
            -P ${KVT_NEEDLE_SAME})
endif()

# Preemption drill: --snapshot-at snapshots every request to a file at that step of each
# replay, destroys it and restores it; the CSV must be the run's without it (salience closes,
# the random selector, and random eviction on a RoPE layer, on both sides of the snapshot).
if(TARGET kvtier-needle)
  set(KVT_NEEDLE_SNAP ${CMAKE_CURRENT_BINARY_DIR}/needle_snapshot_same.cmake)
  file(WRITE ${KVT_NEEDLE_SNAP} [=[
set(common --synthetic --context 4096 --ratio 8,32 --needles 2 --seed 5 --block 256 --kappa 8)
file(REMOVE_RECURSE ${DIR}/needle_snapshots)
file(MAKE_DIRECTORY ${DIR}/needle_snapshots)
foreach(kind nope rope)
  # Steps of 256 rows (salience: after 3 closes) or 32 (RoPE: after the first round).
  set(extra --mode salience,random,dense)
  set(at 3)
  if(kind STREQUAL "rope")
    set(extra --mode salience --rope --recent 32)
    set(at 20)
  endif()
  execute_process(COMMAND ${BIN} ${common} ${extra} --csv ${DIR}/needle_plain_${kind}.csv
                  RESULT_VARIABLE a OUTPUT_QUIET)
  execute_process(COMMAND ${BIN} ${common} ${extra} --snapshot-at ${at}
                  --snapshot-dir ${DIR}/needle_snapshots --csv ${DIR}/needle_snap_${kind}.csv
                  RESULT_VARIABLE b OUTPUT_QUIET ERROR_VARIABLE e)
  if(NOT a EQUAL 0 OR NOT b EQUAL 0)
    message(FATAL_ERROR "${kind}: exit statuses ${a} (plain) and ${b} (snapshot): ${e}")
  endif()
  file(READ ${DIR}/needle_plain_${kind}.csv x)
  file(READ ${DIR}/needle_snap_${kind}.csv y)
  if(NOT x STREQUAL y OR x STREQUAL "")
    message(FATAL_ERROR "${kind}: the CSV with --snapshot-at differs from the plain run's")
  endif()
endforeach()
if(NOT EXISTS ${DIR}/needle_snapshots/r1.kvts)
  message(FATAL_ERROR "no snapshot file kept in --snapshot-dir")
endif()
# kvtier-inspect snapshot reads it (text and JSON), --verify passes; one flipped byte fails.
set(f ${DIR}/needle_snapshots/r1.kvts)
execute_process(COMMAND ${INSPECT} snapshot ${f} --verify RESULT_VARIABLE a OUTPUT_VARIABLE o)
if(NOT a EQUAL 0 OR NOT o MATCHES "verified: every CRC.*random-evict.*recall: off")
  message(FATAL_ERROR "inspect snapshot --verify: ${a}\n${o}")
endif()
execute_process(COMMAND ${INSPECT} snapshot ${f} --json RESULT_VARIABLE a OUTPUT_VARIABLE o)
if(NOT a EQUAL 0 OR NOT o MATCHES "^{\"file\".*\"rounds\":[1-9].*\"memory\"")
  message(FATAL_ERROR "inspect snapshot --json: ${a}\n${o}")
endif()
file(COPY_FILE ${f} ${f}.bad)
execute_process(COMMAND printf "\\377" COMMAND dd of=${f}.bad bs=1 seek=300 conv=notrunc
                RESULT_VARIABLE a ERROR_QUIET)
execute_process(COMMAND ${INSPECT} snapshot ${f}.bad --verify RESULT_VARIABLE a
                OUTPUT_QUIET ERROR_VARIABLE e)
if(NOT a EQUAL 1 OR NOT e MATCHES "CRC mismatch")
  message(FATAL_ERROR "inspect snapshot --verify of a corrupted file: ${a}: ${e}")
endif()
# A recalling request's snapshot: the same CSV with and without the drill; inspect needs the
# layer's basis (--basis; without it: a mismatch that names the option) and shows the trigger.
set(rc --synthetic --context 8192 --ratio 32 --needles 2 --seed 5 --block 1024 --mode recall)
file(REMOVE ${DIR}/needle_snapshots/r1.kvts)
execute_process(COMMAND ${BIN} ${rc} --csv ${DIR}/needle_plain_recall.csv RESULT_VARIABLE a
                OUTPUT_QUIET)
execute_process(COMMAND ${BIN} ${rc} --snapshot-at 14 --snapshot-dir ${DIR}/needle_snapshots
                --write-basis ${DIR}/needle_snapshots/b.kvtb --csv ${DIR}/needle_snap_recall.csv
                RESULT_VARIABLE b OUTPUT_QUIET ERROR_VARIABLE e)
file(READ ${DIR}/needle_plain_recall.csv x)
file(READ ${DIR}/needle_snap_recall.csv y)
if(NOT a EQUAL 0 OR NOT b EQUAL 0 OR NOT x STREQUAL y OR NOT x MATCHES "pass_by")
  message(FATAL_ERROR "recall: exit statuses ${a} / ${b}, or the CSVs differ: ${e}")
endif()
execute_process(COMMAND ${INSPECT} snapshot ${f} --verify RESULT_VARIABLE a OUTPUT_QUIET
                ERROR_VARIABLE e)
if(NOT a EQUAL 1 OR NOT e MATCHES "KVT_ERR_MISMATCH.*--basis")
  message(FATAL_ERROR "inspect snapshot of a recall snapshot without its basis: ${a}: ${e}")
endif()
execute_process(COMMAND ${INSPECT} snapshot ${f} --verify --basis ${DIR}/needle_snapshots/b.kvtb
                RESULT_VARIABLE a OUTPUT_VARIABLE o ERROR_VARIABLE e)
if(NOT a EQUAL 0 OR NOT o MATCHES "recall conformal, calibrating, z 8 from [0-9]+ samples.*basis rank 64")
  message(FATAL_ERROR "inspect snapshot --basis: ${a}\n${o}${e}")
endif()
execute_process(COMMAND ${INSPECT} snapshot ${f} --json --basis ${DIR}/needle_snapshots/b.kvtb
                RESULT_VARIABLE a OUTPUT_VARIABLE o)
if(NOT a EQUAL 0 OR NOT o MATCHES "\"recall\":{\"mode\":\"conformal\".*\"recall_layers\":1")
  message(FATAL_ERROR "inspect snapshot --json --basis: ${a}\n${o}")
endif()
]=])
  add_test(NAME needle_snapshot_same_csv
    COMMAND ${CMAKE_COMMAND} -DBIN=$<TARGET_FILE:kvtier-needle> -DDIR=${CMAKE_CURRENT_BINARY_DIR}
            -DINSPECT=$<TARGET_FILE:kvtier-inspect>
            -P ${KVT_NEEDLE_SNAP})
endif()

# A RoPE layer's key basis from a file (--recall-basis FILE, kvt_ctx_load_recall_head_basis): the
# generator's subspace written with --write-basis gives the CSV of the run that sets it directly;
# a file of another dim (kvtier-inspect calibrate's fit of Gemma's 256-dim keys) is refused by
# name (the tool used to hand it to kvt_ctx_set_recall_head_basis, which read 512-dim rows past
# the 256-dim buffer).
if(TARGET kvtier-needle AND TARGET kvtier-inspect AND KVT_HAVE_LAPACKE)
  set(KVT_NEEDLE_RBASIS ${CMAKE_CURRENT_BINARY_DIR}/needle_rope_basis_file.cmake)
  file(WRITE ${KVT_NEEDLE_RBASIS} [=[
set(common --synthetic --rope --mode recall --context 2048 --needles 1 --seed 3 --no-progress)
execute_process(COMMAND ${BIN} ${common} --write-basis ${DIR}/needle_rope_b.kvtb
                --csv ${DIR}/needle_rope_a.csv RESULT_VARIABLE a OUTPUT_QUIET)
execute_process(COMMAND ${BIN} ${common} --recall-basis ${DIR}/needle_rope_b.kvtb
                --csv ${DIR}/needle_rope_b.csv RESULT_VARIABLE b OUTPUT_QUIET ERROR_VARIABLE e)
file(READ ${DIR}/needle_rope_a.csv x)
file(READ ${DIR}/needle_rope_b.csv y)
if(NOT a EQUAL 0 OR NOT b EQUAL 0 OR NOT x STREQUAL y OR NOT x MATCHES "pass_by")
  message(FATAL_ERROR "exit statuses ${a} / ${b}, or the CSVs differ: ${e}")
endif()
execute_process(COMMAND ${INSPECT} calibrate ${TRACE} -o ${DIR}/needle_rope_gemma --rank 16
                RESULT_VARIABLE a OUTPUT_QUIET ERROR_VARIABLE e)
execute_process(COMMAND ${BIN} ${common} --recall-basis ${DIR}/needle_rope_gemma.h0
                RESULT_VARIABLE b OUTPUT_QUIET ERROR_VARIABLE e2)
if(NOT a EQUAL 0 OR b EQUAL 0 OR NOT e2 MATCHES "kvt_ctx_load_recall_head_basis.*dim 256.*key dim 512")
  message(FATAL_ERROR "calibrate ${a}: ${e}; needle with a 256-dim basis: ${b}: ${e2}")
endif()
]=])
  add_test(NAME needle_rope_basis_file
    COMMAND ${CMAKE_COMMAND} -DBIN=$<TARGET_FILE:kvtier-needle>
            -DINSPECT=$<TARGET_FILE:kvtier-inspect> -DDIR=${CMAKE_CURRENT_BINARY_DIR}
            -DTRACE=${PROJECT_SOURCE_DIR}/tests/data/gemma3-270m-fact-1k.kvtt
            -P ${KVT_NEEDLE_RBASIS})
endif()

# --recall-adapt (the basis refitted to the request's own decode queries between steps,
# kvt_ctx_refit_recall_basis) composes with the rest of the replay: the guarded backend, a
# preemption drill before the first refit (replay step 12: 8 prefill steps of 1,024 rows, then
# decode step 4) and one after the third (step 44: decode step 36), and a batch of two give the
# plain run's CSV (the batch: request 1's rows, and request 2's with its id changed); the summary
# line counts the refits (3: a 40-step decode phase reaches 8, 16 and 32 queries). In the CUDA
# emulation's build (KVT_CUDA_EMU) the same script with -DCUDA=1 checks the CUDA backend's CSV
# too, as ctest cuda_emu_needle_adapt (label cuda_emu, KVT_REQUIRE_GPU=1).
if(TARGET kvtier-needle AND KVT_HAVE_LAPACKE)
  set(KVT_NEEDLE_ADAPT ${CMAKE_CURRENT_BINARY_DIR}/needle_adapt_same.cmake)
  file(WRITE ${KVT_NEEDLE_ADAPT} [=[
set(common --synthetic --context 8192 --block 1024 --needles 2 --salience none
    --depth 0.1,0.5,0.9 --mode recall --ratio 32 --seed 7 --recall-adapt --no-progress)
# its own folder (the CUDA run another), so that ctest -j can run both at once
set(W ${DIR}/needle_adapt)
if(CUDA)
  set(W ${DIR}/needle_adapt_cuda_emu)
endif()
file(REMOVE_RECURSE ${W})
file(MAKE_DIRECTORY ${W}/snap)
execute_process(COMMAND ${BIN} ${common} --csv ${W}/plain.csv RESULT_VARIABLE a
                OUTPUT_VARIABLE o ERROR_VARIABLE e)
if(NOT a EQUAL 0 OR NOT o MATCHES "\nrecall conformal 8k 32x \\(1 haystack\\): pass [0-9]+/6 [^\n]*; refits 3\n")
  message(FATAL_ERROR "plain: exit status ${a}: ${o}${e}")
endif()
file(READ ${W}/plain.csv x)
# name:flag:value (a list of lists would flatten)
set(variants guarded:--backend:guarded snap12:--snapshot-at:12 snap44:--snapshot-at:44)
if(CUDA)
  list(APPEND variants cuda:--backend:cuda)
endif()
foreach(v ${variants})
  string(REPLACE ":" ";" v "${v}")
  list(POP_FRONT v name)
  execute_process(COMMAND ${BIN} ${common} ${v} --snapshot-dir ${W}/snap
                  --csv ${W}/${name}.csv RESULT_VARIABLE a OUTPUT_QUIET
                  ERROR_VARIABLE e)
  file(READ ${W}/${name}.csv y)
  if(NOT a EQUAL 0 OR NOT x STREQUAL y OR NOT x MATCHES "pass_by")
    message(FATAL_ERROR "${name}: exit status ${a}, or its CSV differs from the plain run's: ${e}")
  endif()
  if(name MATCHES "^snap" AND NOT EXISTS ${W}/snap/r1.kvts)
    message(FATAL_ERROR "${name}: no snapshot was written (the drill did not run)")
  endif()
  file(REMOVE ${W}/snap/r1.kvts)
endforeach()
execute_process(COMMAND ${BIN} ${common} --batch 2 --csv ${W}/batch.csv
                RESULT_VARIABLE a OUTPUT_QUIET ERROR_VARIABLE e)
file(STRINGS ${W}/batch.csv rows)
file(STRINGS ${W}/plain.csv plain)
list(POP_FRONT rows head)
set(r1 "")
set(r2 "")
foreach(r ${rows})
  if(r MATCHES "^[0-9]+,[0-9]+,1,")
    list(APPEND r1 "${r}")
  else()
    string(REGEX REPLACE "^([0-9]+,[0-9]+,)2," "\\11," r "${r}")
    list(APPEND r2 "${r}")
  endif()
endforeach()
list(POP_FRONT plain phead)
if(NOT a EQUAL 0 OR NOT head STREQUAL phead OR NOT r1 STREQUAL plain OR NOT r2 STREQUAL plain)
  message(FATAL_ERROR "batch of 2: exit status ${a}, or a request's rows differ from the plain "
                      "run's: ${e}")
endif()
]=])
  add_test(NAME needle_adapt_same_csv
    COMMAND ${CMAKE_COMMAND} -DBIN=$<TARGET_FILE:kvtier-needle> -DDIR=${CMAKE_CURRENT_BINARY_DIR}
            -P ${KVT_NEEDLE_ADAPT})
  if(KVT_CUDA_EMU) # kvt_cuda_emu_test: tests/scripts/cuda_emu.cmake, read before this file
    kvt_cuda_emu_test(cuda_emu_needle_adapt cuda_emu ${CMAKE_COMMAND}
      -DBIN=$<TARGET_FILE:kvtier-needle> -DDIR=${CMAKE_CURRENT_BINARY_DIR} -DCUDA=1
      -P ${KVT_NEEDLE_ADAPT})
  endif()
endif()
