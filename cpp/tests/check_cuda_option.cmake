# ctest's ATTNRES_CUDA option check (cmake -P): configuring with a value other than AUTO, ON or OFF must fail and
# name the accepted values (before, `-DATTNRES_CUDA=no` or `=0` built the CUDA backend silently). Configure
# only, into a scratch directory: no compilation. Inputs: SOURCE_DIR, WORK_DIR, GENERATOR.
cmake_minimum_required(VERSION 3.24)

foreach(value bogus no 0 yes)
  set(dir ${WORK_DIR}/${value})
  file(REMOVE_RECURSE ${dir})
  execute_process(
    COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${dir} -G ${GENERATOR} -DATTNRES_CUDA=${value}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  file(REMOVE_RECURSE ${dir})
  if(rc EQUAL 0)
    message(FATAL_ERROR "ATTNRES_CUDA=${value}: configure succeeded, expected an error")
  endif()
  if(NOT err MATCHES "accepted values are AUTO, ON and OFF")
    message(FATAL_ERROR "ATTNRES_CUDA=${value}: configure failed without naming the accepted values:\n${err}")
  endif()
  message(STATUS "ATTNRES_CUDA=${value}: rejected")
endforeach()
