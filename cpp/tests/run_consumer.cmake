# ctest's consumer check (cmake -P): install the build at BUILD_DIR into a scratch prefix, then configure,
# build and run the consumer project at SOURCE_DIR against that prefix only.
# With ADD_SUBDIRECTORY=<attnres sources> instead: build the consumer with attnres added as a subdirectory (CPU
# backend), with no CMAKE_BUILD_TYPE given, and check attnres left the consumer's build type unset.
# Inputs: BUILD_DIR, SOURCE_DIR, WORK_DIR, GENERATOR, CXX_COMPILER, CUDA_COMPILER (empty without CUDA).
cmake_minimum_required(VERSION 3.24)

set(prefix ${WORK_DIR}/prefix)
set(build ${WORK_DIR}/build)
# Start from nothing each time: a stale prefix or cache would hide a missing installed file.
file(REMOVE_RECURSE ${WORK_DIR})

function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer check: ${what} failed (${rc})")
  endif()
endfunction()

if(ADD_SUBDIRECTORY)
  step("configure (add_subdirectory)" ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${build} -G ${GENERATOR}
       -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DATTNRES_SOURCE_DIR=${ADD_SUBDIRECTORY} -DATTNRES_CUDA=OFF)
  file(STRINGS ${build}/CMakeCache.txt build_type REGEX "^CMAKE_BUILD_TYPE:")
  if(NOT build_type MATCHES "^CMAKE_BUILD_TYPE:[A-Z]*=$")
    message(FATAL_ERROR "consumer check: attnres under add_subdirectory set the parent's build type: ${build_type}")
  endif()
  step("build" ${CMAKE_COMMAND} --build ${build})
  step("run" ${build}/attnres_consumer)
  message(STATUS "consumer check: add_subdirectory(attnres) built and ran; the parent's build type stayed unset")
  return()
endif()

step("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
# A C++ install holds the library, headers and package config only: the Python extension (component "python",
# installed by the wheel) must not land in the C++ prefix, even when this build also built it.
file(GLOB_RECURSE extension RELATIVE ${prefix} ${prefix}/*_C.*so ${prefix}/*.py)
if(extension)
  message(FATAL_ERROR "consumer check: cmake --install put Python files into the C++ prefix: ${extension}")
endif()

set(configure ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${build} -G ${GENERATOR}
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
    # Only the scratch prefix: the consumer must not find the build tree's package registry entry.
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
if(CUDA_COMPILER)
  # A CUDA build's package config finds the CUDA toolkit (cudart) next to this compiler.
  get_filename_component(cuda_bin ${CUDA_COMPILER} DIRECTORY)
  get_filename_component(cuda_root ${cuda_bin} DIRECTORY)
  list(APPEND configure -DCUDAToolkit_ROOT=${cuda_root})
endif()
step("configure" ${configure})
step("build" ${CMAKE_COMMAND} --build ${build})
step("run" ${build}/attnres_consumer)
message(STATUS "consumer check: find_package(attnres) from ${prefix} built and ran")
